/* segment_mean.cu — mean over each sequence's packed rows (global average pooling heads): out
 * (B, C) from packed (T, C) and cu_seqlens (B+1,), rows [cu[b] + skip, cu[b+1]), float32
 * accumulation, zeros for an empty range. grid = (B, ceil(C / 64)), 256 threads: 64 channels x 4
 * row phases; each thread sums rows phase, phase + 4, ... of one channel. Decision: phase 0 adds
 * the four partial sums in a fixed order, no atomics, so the same rows always give the same bits
 * (a pruning policy thresholding on the mean then decides the same way every run).
 * Covered by tests/test_segment_mean.py (vs a float64 reference). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_util.cuh"
#include "elem.cuh"

static constexpr int kMeanChannels = 64;
static constexpr int kMeanPhases = 4;
static constexpr int kMeanThreads = kMeanChannels * kMeanPhases;

// ---- kernels ----

template <typename T>
static __global__ void __launch_bounds__(kMeanThreads)
    segment_mean_kernel(const ragvit_segment_mean_args a) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    __shared__ float partial_s[kMeanPhases][kMeanChannels];
    const int64_t b = blockIdx.x;
    const int lane_c = threadIdx.x % kMeanChannels;
    const int phase = threadIdx.x / kMeanChannels;
    const int64_t c = (int64_t)blockIdx.y * kMeanChannels + lane_c;
    const int64_t start = a.cu_seqlens[b * a.cu_seqlens_stride];
    const int64_t end = a.cu_seqlens[(b + 1) * a.cu_seqlens_stride];
    const int64_t first = start + a.skip; /* skip <= 2^31-1: no overflow */
    int64_t count = 0;                    /* uniform over the block */
    if (start < 0 || end < start || end > a.total_tokens) {
        if (blockIdx.y == 0 && threadIdx.x == 0)
            if (a.error_flag != nullptr) atomicOr(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
    } else if (first < end) {
        count = end - first;
    }
    const T *packed = static_cast<const T *>(a.packed);
    float acc = 0.0f;
    if (c < a.channels) {
        for (int64_t t = phase; t < count; t += kMeanPhases)
            acc += elem_load(packed + (first + t) * a.packed_stride_token + c);
    }
    partial_s[phase][lane_c] = acc;
    __syncthreads();
    if (phase == 0 && c < a.channels) {
        float sum = partial_s[0][lane_c];
#pragma unroll
        for (int p = 1; p < kMeanPhases; p++) sum += partial_s[p][lane_c];
        const float scale = count > 0 ? 1.0f / (float)count : 0.0f;
        elem_store(static_cast<T *>(a.out) + b * a.out_stride_b + c, sum * scale);
    }
}

// ---- launcher ----

template <typename T>
static ragvit_status segment_mean_launch(const ragvit_segment_mean_args *a, dim3 grid,
                                         const ragvit_device_info *dev, cudaStream_t stream) {
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_SEGMENT, segment_mean_kernel<T>, grid, kMeanThreads, 0,
                         stream, *a));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_segment_mean(const ragvit_segment_mean_args *a,
                                                  const ragvit_device_info *dev, void *stream) {
    if (a->batch <= 0 || a->channels <= 0) return RAGVIT_STATUS_OK;
    const int64_t slices = (a->channels + kMeanChannels - 1) / kMeanChannels;
    if (a->batch > INT32_MAX || slices > 65535 || a->skip < 0 || a->skip > INT32_MAX)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "segment_mean: out must have B < 2^31 and C <= %d, skip < 2^31, got "
                           "B=%lld, C=%lld, skip=%lld",
                           65535 * kMeanChannels, (long long)a->batch, (long long)a->channels,
                           (long long)a->skip);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const dim3 grid((unsigned)a->batch, (unsigned)slices);
    const cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: return segment_mean_launch<__half>(a, grid, dev, s);
    case RAGVIT_DTYPE_BF16: return segment_mean_launch<__nv_bfloat16>(a, grid, dev, s);
    case RAGVIT_DTYPE_F32: return segment_mean_launch<float>(a, grid, dev, s);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "segment_mean: packed must be float16, bfloat16 or float32, got dtype "
                           "code %d",
                           (int)a->dtype);
    }
}
