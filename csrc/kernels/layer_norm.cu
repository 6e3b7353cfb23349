/* layer_norm.cu — LayerNorm over the last dim of packed rows: out (M, C) from
 * x (M, C), optional weight/bias (C,), float32 statistics (two passes over the
 * row held in registers: mean, then the biased variance of x - mean), rounded
 * once on store. One warp a row, 4 warps a block; lane l holds columns
 * l, l + 32, ... (kPerLane of them, chosen from C at launch; C above
 * 32 * kLayerNormMaxPerLane re-reads the row from global memory instead).
 * In place (out == x) is safe: a warp reads its whole row before writing it.
 * Covered by tests/test_rowwise.py (vs float64 and torch.nn.functional.layer_norm). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_check.cuh"
#include "float_elems.cuh"

static constexpr int kLayerNormWarps = 4;
static constexpr int kLayerNormMaxPerLane = 64; /* C <= 2048 stays in registers */

// ---- device helpers ----

static __device__ __forceinline__ float layer_norm_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- kernels ----

/* kPerLane > 0: the row lives in registers; kPerLane == 0: any C, three reads. */
template <typename T, int kPerLane>
static __global__ void __launch_bounds__(kLayerNormWarps * 32)
    layer_norm_kernel(const ragvit_rowwise_args a) {
    const int lane = threadIdx.x % 32;
    const int64_t m = (int64_t)blockIdx.x * kLayerNormWarps + threadIdx.x / 32;
    if (m >= a.rows)
        return;
    const T *x = static_cast<const T *>(a.x) + m * a.x_stride;
    T *out = static_cast<T *>(a.out) + m * a.out_stride;
    const T *w = static_cast<const T *>(a.weight);
    const T *b = static_cast<const T *>(a.bias);
    const int64_t C = a.channels;
    const float inv_c = 1.0f / (float)C;
    float mean = 0.0f, var = 0.0f;
    if constexpr (kPerLane > 0) {
        float v[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; i++) {
            const int64_t c = lane + 32 * i;
            v[i] = c < C ? float_elems_load(x + c) : 0.0f;
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
            if (c < C) {
                float y = (v[i] - mean) * rstd;
                if (w != nullptr)
                    y *= float_elems_load(w + c * a.weight_stride);
                if (b != nullptr)
                    y += float_elems_load(b + c * a.bias_stride);
                float_elems_store(out + c, y);
            }
        }
    } else {
        for (int64_t c = lane; c < C; c += 32)
            mean += float_elems_load(x + c);
        mean = layer_norm_warp_sum(mean) * inv_c;
        for (int64_t c = lane; c < C; c += 32) {
            const float d = float_elems_load(x + c) - mean;
            var += d * d;
        }
        const float rstd = rsqrtf(layer_norm_warp_sum(var) * inv_c + a.eps);
        __syncwarp(); /* in place: every lane has read the row before any lane writes */
        for (int64_t c = lane; c < C; c += 32) {
            float y = (float_elems_load(x + c) - mean) * rstd;
            if (w != nullptr)
                y *= float_elems_load(w + c * a.weight_stride);
            if (b != nullptr)
                y += float_elems_load(b + c * a.bias_stride);
            float_elems_store(out + c, y);
        }
    }
}

// ---- launcher ----

template <typename T>
static ragvit_status layer_norm_launch(const ragvit_rowwise_args *a, cudaStream_t stream) {
    const int64_t blocks = (a->rows + kLayerNormWarps - 1) / kLayerNormWarps;
    const dim3 grid((unsigned)blocks), block(kLayerNormWarps * 32);
    const int64_t per_lane = (a->channels + 31) / 32;
    if (per_lane <= 8)
        layer_norm_kernel<T, 8><<<grid, block, 0, stream>>>(*a);
    else if (per_lane <= 16)
        layer_norm_kernel<T, 16><<<grid, block, 0, stream>>>(*a);
    else if (per_lane <= 32)
        layer_norm_kernel<T, 32><<<grid, block, 0, stream>>>(*a);
    else if (per_lane <= kLayerNormMaxPerLane)
        layer_norm_kernel<T, kLayerNormMaxPerLane><<<grid, block, 0, stream>>>(*a);
    else
        layer_norm_kernel<T, 0><<<grid, block, 0, stream>>>(*a);
    CUDA_TRY(cudaGetLastError());
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_layer_norm(const ragvit_rowwise_args *a,
                                                const ragvit_device_info *dev, void *stream) {
    if (a->rows <= 0 || a->channels <= 0)
        return RAGVIT_STATUS_OK;
    if ((a->rows + kLayerNormWarps - 1) / kLayerNormWarps > INT32_MAX)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "layer_norm: x must have fewer than 2^33 rows, got %lld",
                           (long long)a->rows);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16:
        return layer_norm_launch<__half>(a, s);
    case RAGVIT_DTYPE_BF16:
        return layer_norm_launch<__nv_bfloat16>(a, s);
    case RAGVIT_DTYPE_F32:
        return layer_norm_launch<float>(a, s);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "layer_norm: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
}
