/* gelu.cu — exact (erf) GELU of packed rows: out (M, C) = x * Phi(x) in float32, rounded once;
 * out may be x (each element is read, then written, by the same thread). grid = (min(chunks / 256,
 * 16 * SMs),), 256 threads, grid-stride over M * C / kVec chunks of kVec elements: 16 bytes when C,
 * both row strides and both pointers allow it, else one element. Decision: float16 / bfloat16 take
 * Phi from a rational erfc (gelu_erfc) instead of erff: fewer instructions, 17.5 vs 20.5 us at
 * M = 4624, C = 3072 fp16 on the H200, and within 4e-7 of the float64 GELU, far under a 16-bit
 * output's rounding (docs/kernels/pack.md). float32 keeps erff.
 * Covered by tests/test_gelu.py (vs float64 and torch's exact GELU). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_util.cuh"
#include "elem.cuh"

static constexpr int kGeluThreads = 256;

// ---- device helpers ----

static __device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

/* x * Phi(x) with Phi(x) = 1 - e (x >= 0) or e (x < 0), e = erfc(|x| / sqrt 2) / 2 =
 * t exp(-z^2 + P(t)) / 2, t = 1 / (1 + z / 2): Numerical Recipes' erfcc (fractional error
 * <= 1.2e-7), its 0.5 folded into exp2. In float32 arithmetic the GELU is within 4e-7 of the
 * float64 one everywhere, relatively within 2e-5 where it is below 1e-14; against erff it moves
 * 0.25% of fp16 outputs by one ulp, none by more than 4e-6. */
static __device__ __forceinline__ float gelu_erfc(float x) {
    const float z = fabsf(x) * 0.70710678118654752f;
    float t;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(0.5f, z, 1.0f)));
    float p = 0.17087277f;
    p = fmaf(p, t, -0.82215223f);
    p = fmaf(p, t, 1.48851587f);
    p = fmaf(p, t, -1.13520398f);
    p = fmaf(p, t, 0.27886807f);
    p = fmaf(p, t, -0.18628806f);
    p = fmaf(p, t, 0.09678418f);
    p = fmaf(p, t, 0.37409196f);
    p = fmaf(p, t, 1.00002368f);
    p = fmaf(p, t, -1.26551223f);
    float half_exp; /* exp(-z^2 + P) / 2 */
    asm("ex2.approx.ftz.f32 %0, %1;"
        : "=f"(half_exp)
        : "f"(fmaf(fmaf(-z, z, p), 1.4426950408889634f, -1.0f)));
    const float e = t * half_exp;
    return x * (x >= 0.0f ? 1.0f - e : e);
}

/* GELU of one element of a T tensor, in float32 (see the file comment for the two forms). */
template <typename T> static __device__ __forceinline__ float gelu_value(float v) {
    if constexpr (sizeof(T) == 4)
        return gelu_erf(v);
    else
        return gelu_erfc(v);
}

// ---- kernels ----

/* kVec elements a chunk: 1, or 16 bytes' worth (the launcher checked alignment). kIsFlat: x and
 * out are both dense (row stride == C), so chunk i sits at i * kVec in both and the row/column
 * split (a 64-bit division per chunk) is skipped. One chunk a thread per iteration: two in flight
 * measured slower (the loop is bound by the erf math, docs/experiments.md). */
template <typename T, int kVec, bool kIsFlat>
static __global__ void __launch_bounds__(kGeluThreads) gelu_kernel(const ragvit_rowwise_args a) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    struct alignas(kVec * sizeof(T)) chunk {
        T v[kVec];
    };
    const int64_t chunks_per_row = a.channels / kVec;
    const int64_t total = a.rows * chunks_per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x_at = i * kVec, out_at = i * kVec;
        if constexpr (!kIsFlat) {
            const int64_t m = i / chunks_per_row, c = (i - m * chunks_per_row) * kVec;
            x_at = m * a.x_stride + c;
            out_at = m * a.out_stride + c;
        }
        chunk in = *reinterpret_cast<const chunk *>(static_cast<const T *>(a.x) + x_at);
#pragma unroll
        for (int j = 0; j < kVec; j++) elem_store(&in.v[j], gelu_value<T>(elem_load(&in.v[j])));
        *reinterpret_cast<chunk *>(static_cast<T *>(a.out) + out_at) = in;
    }
}

// ---- launcher ----

template <typename T>
static ragvit_status gelu_launch(const ragvit_rowwise_args *a, const ragvit_device_info *dev,
                                 cudaStream_t stream) {
    constexpr int kVec = 16 / (int)sizeof(T);
    const int64_t es = (int64_t)sizeof(T);
    const bool is_vec = a->channels % kVec == 0 && (a->x_stride * es) % 16 == 0 &&
                        (a->out_stride * es) % 16 == 0 && (uintptr_t)a->x % 16 == 0 &&
                        (uintptr_t)a->out % 16 == 0;
    const int64_t chunks = a->rows * (is_vec ? a->channels / kVec : a->channels);
    int64_t blocks = (chunks + kGeluThreads - 1) / kGeluThreads;
    const int64_t cap = (int64_t)(dev->sm_count > 0 ? dev->sm_count : 1) * 16;
    if (blocks > cap) blocks = cap; /* grid-stride beyond a few waves */
    const bool is_flat = a->x_stride == a->channels && a->out_stride == a->channels;
    if (is_vec && is_flat)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_GELU, gelu_kernel<T, kVec, true>, (unsigned)blocks,
                             kGeluThreads, 0, stream, *a));
    else if (is_vec)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_GELU, gelu_kernel<T, kVec, false>, (unsigned)blocks,
                             kGeluThreads, 0, stream, *a));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_GELU, gelu_kernel<T, 1, false>, (unsigned)blocks,
                             kGeluThreads, 0, stream, *a));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_gelu(const ragvit_rowwise_args *a,
                                          const ragvit_device_info *dev, void *stream) {
    if (a->rows <= 0 || a->channels <= 0) return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: return gelu_launch<__half>(a, dev, s);
    case RAGVIT_DTYPE_BF16: return gelu_launch<__nv_bfloat16>(a, dev, s);
    case RAGVIT_DTYPE_F32: return gelu_launch<float>(a, dev, s);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "gelu: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
}
