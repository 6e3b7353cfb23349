/* float_elems.cuh — one element of a float16 / bfloat16 / float32 tensor to and
 * from float (round to nearest even), for kernels that do float32 arithmetic on
 * any of the three dtypes (segment_mean.cu, the fused token of pack_tokens.cu).
 * Decision: overloads rather than a dtype switch per element; each kernel is
 * templated on the element type and dispatched once in its launcher. */
#ifndef RAGVIT_FLOAT_ELEMS_CUH
#define RAGVIT_FLOAT_ELEMS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

static __device__ __forceinline__ float float_elems_load(const float *p) { return *p; }
static __device__ __forceinline__ float float_elems_load(const __half *p) {
    return __half2float(*p);
}
static __device__ __forceinline__ float float_elems_load(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
static __device__ __forceinline__ void float_elems_store(float *p, float v) { *p = v; }
static __device__ __forceinline__ void float_elems_store(__half *p, float v) {
    *p = __float2half_rn(v);
}
static __device__ __forceinline__ void float_elems_store(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16_rn(v);
}

#endif /* RAGVIT_FLOAT_ELEMS_CUH */
