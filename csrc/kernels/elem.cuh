/* elem.cuh — one element of a float16 / bfloat16 / float32 tensor to and from float (round to
 * nearest even), for the kernels that do float32 arithmetic on any of the three dtypes
 * (segment_mean.cu, layer_norm.cu, gelu.cu, topk_index.cu, the EViT fused token of pack.cu).
 * Decision: overloads rather than a dtype switch per element; each kernel is templated on the
 * element type and dispatched once in its launcher. */
#ifndef RAGVIT_ELEM_CUH
#define RAGVIT_ELEM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

static __device__ __forceinline__ float elem_load(const float *p) { return *p; }
static __device__ __forceinline__ float elem_load(const __half *p) { return __half2float(*p); }
static __device__ __forceinline__ float elem_load(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
static __device__ __forceinline__ void elem_store(float *p, float v) { *p = v; }
static __device__ __forceinline__ void elem_store(__half *p, float v) { *p = __float2half_rn(v); }
static __device__ __forceinline__ void elem_store(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16_rn(v);
}

#endif /* RAGVIT_ELEM_CUH */
