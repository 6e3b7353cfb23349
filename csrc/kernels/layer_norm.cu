/* layer_norm.cu — LayerNorm over the last dim of packed rows: out (M, C) from x (M, C) and
 * optional weight / bias (C,), float32 statistics (mean, then the biased variance of x - mean),
 * rounded once on store. Vector path (C % 8 == 0, C <= 1024, 16-byte aligned): grid = (min(M / 4,
 * 16 * SMs),), 4 warps, each warp looping over rows; scalar path (anything else): grid =
 * (ceil(M / 4),), one warp a row. Decision: the vector path keeps only raw rows in registers (see
 * layer_norm_vec_kernel: 50 registers at C = 768 instead of 128). In place (out == x) is safe: a
 * warp reads its whole row before writing it.
 * Covered by tests/test_layer_norm.py (vs float64 and torch.nn.functional.layer_norm). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "cuda_util.cuh"
#include "elem.cuh"

static constexpr int kLayerNormWarps = 4;
static constexpr int kLayerNormMaxPerLane = 32;  /* C <= 1024 stays in registers */
static constexpr int kLayerNormBlocksPerSm = 16; /* vector path grid cap, per SM */

// ---- device helpers ----

static __device__ __forceinline__ float layer_norm_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Row m's affine output for column c (weight and bias preloaded as floats). */
static __device__ __forceinline__ float layer_norm_affine(float v, float mean, float rstd, float w,
                                                          float b) {
    return (v - mean) * rstd * w + b;
}

/* 16-byte chunk ch of an affine parameter (weight or bias: contiguous, 16-byte aligned;
 * NULL: every element fill). The load is volatile so the compiler cannot hoist it out of
 * the row loop into registers held for the whole kernel (what this path avoids). */
template <typename T, typename Chunk>
static __device__ __forceinline__ Chunk layer_norm_param(const T *p, int ch, float fill) {
    Chunk c;
    if (p == nullptr) {
#pragma unroll
        for (int j = 0; j < 8; j++) elem_store(&c.v[j], fill);
        return c;
    }
    constexpr int kWords = (int)(sizeof(Chunk) / 16); /* 16-byte loads: 1, or 2 for float */
    uint4 u[kWords];
#pragma unroll
    for (int k = 0; k < kWords; k++)
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(u[k].x), "=r"(u[k].y), "=r"(u[k].z), "=r"(u[k].w)
                     : "l"(reinterpret_cast<const uint4 *>(p) + kWords * ch + k));
    memcpy(&c, u, sizeof c);
    return c;
}

// ---- kernels ----

/* Vector path: lane l holds 8-element chunks l, l + 32, ..., kChunks of them (C <= 256 *
 * kChunks, C % 8 == 0, rows, pointers and weight / bias 16-byte aligned, weight and bias
 * contiguous; a chunk is one 16-byte load for 16-bit types, two for float). A warp
 * normalizes rows warp, warp + warps in the grid, ...; its first row is loaded up front
 * and each next row while the current one is reduced, so a warp with one row costs one
 * global round trip and a warp with many overlaps their loads. Decision: registers hold
 * only the two raw rows (statistics and output convert each element again; weight and bias
 * come from L1 per row): 50 registers for fp16 at C = 768, where weight, bias and the row
 * as floats took 128 and left the SM a quarter of its warps; on the H200 (fp16, C = 768,
 * M = 25344) 24.7 instead of 27.2 us (docs/kernels/pack.md). */
template <typename T, int kChunks>
static __global__ void __launch_bounds__(kLayerNormWarps * 32)
    layer_norm_vec_kernel(const ragvit_rowwise_args a) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    struct alignas(16) chunk {
        T v[8];
    };
    const int lane = threadIdx.x % 32;
    const int64_t first = (int64_t)blockIdx.x * kLayerNormWarps + threadIdx.x / 32;
    const int64_t step = (int64_t)gridDim.x * kLayerNormWarps;
    if (first >= a.rows) return;
    const int num_chunks = (int)(a.channels / 8);
    const T *x = static_cast<const T *>(a.x);
    const T *w = static_cast<const T *>(a.weight);
    const T *b = static_cast<const T *>(a.bias);
    chunk in[kChunks]; /* the next row, raw */
#pragma unroll
    for (int i = 0; i < kChunks; i++)
        if (lane + 32 * i < num_chunks)
            in[i] = reinterpret_cast<const chunk *>(x + first * a.x_stride)[lane + 32 * i];
    const float inv_c = 1.0f / (float)a.channels;
    for (int64_t m = first; m < a.rows; m += step) {
        chunk cur[kChunks]; /* the row being normalized, raw */
#pragma unroll
        for (int i = 0; i < kChunks; i++) cur[i] = in[i];
        /* the warp's next row (a different row: in place stays safe) */
        const int64_t next = m + step;
        if (next < a.rows) {
#pragma unroll
            for (int i = 0; i < kChunks; i++)
                if (lane + 32 * i < num_chunks)
                    in[i] = reinterpret_cast<const chunk *>(x + next * a.x_stride)[lane + 32 * i];
        }
        float mean = 0.0f, var = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunks; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                mean += lane + 32 * i < num_chunks ? elem_load(&cur[i].v[j]) : 0.0f;
        mean = layer_norm_warp_sum(mean) * inv_c;
#pragma unroll
        for (int i = 0; i < kChunks; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float d = lane + 32 * i < num_chunks ? elem_load(&cur[i].v[j]) - mean : 0.0f;
                var += d * d;
            }
        const float rstd = rsqrtf(layer_norm_warp_sum(var) * inv_c + a.eps);
        chunk *out = reinterpret_cast<chunk *>(static_cast<T *>(a.out) + m * a.out_stride);
#pragma unroll
        for (int i = 0; i < kChunks; i++) {
            const int ch = lane + 32 * i;
            if (ch < num_chunks) {
                const chunk wc = layer_norm_param<T, chunk>(w, ch, 1.0f);
                const chunk bc = layer_norm_param<T, chunk>(b, ch, 0.0f);
                chunk o;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    elem_store(&o.v[j],
                               layer_norm_affine(elem_load(&cur[i].v[j]), mean, rstd,
                                                 elem_load(&wc.v[j]), elem_load(&bc.v[j])));
                out[ch] = o;
            }
        }
    }
}

/* Scalar path, any C and alignment: lane l holds columns l, l + 32, ... (kPerLane of them),
 * or, with kPerLane == 0 (C > 32 * kLayerNormMaxPerLane), re-reads the row from global. */
template <typename T, int kPerLane>
static __global__ void __launch_bounds__(kLayerNormWarps * 32)
    layer_norm_kernel(const ragvit_rowwise_args a) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    const int lane = threadIdx.x % 32;
    const int64_t m = (int64_t)blockIdx.x * kLayerNormWarps + threadIdx.x / 32;
    if (m >= a.rows) return;
    const T *x = static_cast<const T *>(a.x) + m * a.x_stride;
    T *out = static_cast<T *>(a.out) + m * a.out_stride;
    const T *w = static_cast<const T *>(a.weight);
    const T *b = static_cast<const T *>(a.bias);
    const int64_t C = a.channels;
    const float inv_c = 1.0f / (float)C;
    float mean = 0.0f, var = 0.0f;
    if constexpr (kPerLane > 0) {
        float v[kPerLane], wf[kPerLane], bf[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; i++) {
            const int64_t c = lane + 32 * i;
            v[i] = c < C ? elem_load(x + c) : 0.0f;
            wf[i] = c < C && w != nullptr ? elem_load(w + c * a.weight_stride) : 1.0f;
            bf[i] = c < C && b != nullptr ? elem_load(b + c * a.bias_stride) : 0.0f;
            mean += v[i];
        }
        mean = layer_norm_warp_sum(mean) * inv_c;
#pragma unroll
        for (int i = 0; i < kPerLane; i++) {
            const float d = lane + 32 * i < C ? v[i] - mean : 0.0f;
            var += d * d;
        }
        const float rstd = rsqrtf(layer_norm_warp_sum(var) * inv_c + a.eps);
#pragma unroll
        for (int i = 0; i < kPerLane; i++) {
            const int64_t c = lane + 32 * i;
            if (c < C) elem_store(out + c, layer_norm_affine(v[i], mean, rstd, wf[i], bf[i]));
        }
    } else {
        for (int64_t c = lane; c < C; c += 32) mean += elem_load(x + c);
        mean = layer_norm_warp_sum(mean) * inv_c;
        for (int64_t c = lane; c < C; c += 32) {
            const float d = elem_load(x + c) - mean;
            var += d * d;
        }
        const float rstd = rsqrtf(layer_norm_warp_sum(var) * inv_c + a.eps);
        __syncwarp(); /* in place: every lane has read the row before any lane writes */
        for (int64_t c = lane; c < C; c += 32) {
            const float wv = w != nullptr ? elem_load(w + c * a.weight_stride) : 1.0f;
            const float bv = b != nullptr ? elem_load(b + c * a.bias_stride) : 0.0f;
            elem_store(out + c, layer_norm_affine(elem_load(x + c), mean, rstd, wv, bv));
        }
    }
}

// ---- launcher ----

template <typename T>
static ragvit_status layer_norm_launch(const ragvit_rowwise_args *a, const ragvit_device_info *dev,
                                       cudaStream_t stream) {
    const int64_t blocks = (a->rows + kLayerNormWarps - 1) / kLayerNormWarps;
    /* vector path: a few waves of warps that loop over rows (weight and bias loaded once
     * a warp); the scalar path keeps one row a warp */
    const int64_t cap = (int64_t)(dev->sm_count > 0 ? dev->sm_count : 1) * kLayerNormBlocksPerSm;
    const dim3 grid((unsigned)blocks), vec_grid((unsigned)(blocks < cap ? blocks : cap));
    const dim3 block(kLayerNormWarps * 32);
    const int64_t es = (int64_t)sizeof(T);
    const auto is_vec_param = [](const void *p, int64_t stride) {
        return p == NULL || (stride == 1 && (uintptr_t)p % 16 == 0);
    };
    const bool is_vec = a->channels % 8 == 0 && a->channels <= 256 * 4 &&
                        (a->x_stride * es) % 16 == 0 && (a->out_stride * es) % 16 == 0 &&
                        (uintptr_t)a->x % 16 == 0 && (uintptr_t)a->out % 16 == 0 &&
                        is_vec_param(a->weight, a->weight_stride) &&
                        is_vec_param(a->bias, a->bias_stride);
    const int64_t chunks = (a->channels / 8 + 31) / 32;
    const int64_t per_lane = (a->channels + 31) / 32;
    if (is_vec && chunks <= 1)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_vec_kernel<T, 1>, vec_grid,
                             block, 0, stream, *a));
    else if (is_vec && chunks <= 2)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_vec_kernel<T, 2>, vec_grid,
                             block, 0, stream, *a));
    else if (is_vec && chunks <= 3)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_vec_kernel<T, 3>, vec_grid,
                             block, 0, stream, *a));
    else if (is_vec)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_vec_kernel<T, 4>, vec_grid,
                             block, 0, stream, *a));
    else if (per_lane <= 8)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_kernel<T, 8>, grid, block, 0,
                             stream, *a));
    else if (per_lane <= kLayerNormMaxPerLane)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_kernel<T, kLayerNormMaxPerLane>,
                             grid, block, 0, stream, *a));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_LAYER_NORM, layer_norm_kernel<T, 0>, grid, block, 0,
                             stream, *a));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_layer_norm(const ragvit_rowwise_args *a,
                                                const ragvit_device_info *dev, void *stream) {
    if (a->rows <= 0 || a->channels <= 0) return RAGVIT_STATUS_OK;
    if ((a->rows + kLayerNormWarps - 1) / kLayerNormWarps > INT32_MAX)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "layer_norm: x must have fewer than 2^33 rows, got %lld",
                           (long long)a->rows);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: return layer_norm_launch<__half>(a, dev, s);
    case RAGVIT_DTYPE_BF16: return layer_norm_launch<__nv_bfloat16>(a, dev, s);
    case RAGVIT_DTYPE_F32: return layer_norm_launch<float>(a, dev, s);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "layer_norm: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
}
