/* topk_index.cu — per row of scores (B, L), L <= 8192: the `prefix` leading columns plus the k
 * highest-scoring columns of [prefix, L), ascending, as int32 or int64 indices (what topk + sort +
 * arange + cat computed). grid = (min(B, 2^31 - 1),), 256 threads, one row a block (grid-stride);
 * the row's n = L - prefix keys sit in shared memory (<= 33 KiB). Decision: radix select (4
 * passes of 8 bits over order-preserving uint32 keys) finds the k-th largest key and how many of
 * its ties to keep, then one ordered compaction writes the kept columns ascending: one launch, no
 * sort, no global atomics, deterministic. Covered by tests/test_topk_index.py. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_util.cuh"
#include "elem.cuh"
#include "ragvit_topk_key.h"

static constexpr int kTopkThreads = 256; /* also the number of histogram bins */
static constexpr int kTopkWarps = kTopkThreads / 32;
static constexpr int kTopkRadixBits = 8;

// ---- device helpers ----

/* Order-preserving key of a score (ragvit_topk_key.h, shared with the CPU backend). */
static __device__ __forceinline__ uint32_t topk_key(float score) {
    return topk_key_from_bits(__float_as_uint(score));
}

/* Shared-memory slot of key i: one pad word every 32 keys, so the compaction's
 * contiguous per-thread chunks (stride `chunk` across a warp) hit distinct
 * banks when chunk is a multiple of 32. */
static __host__ __device__ __forceinline__ constexpr int topk_slot(int i) { return i + (i >> 5); }

/* Exclusive prefix sum of one int per thread over the block, in thread order.
 * scratch: kTopkWarps ints of shared memory. Every thread must call it: it
 * synchronizes, and ends with a barrier so scratch can be reused at once. */
static __device__ __forceinline__ int topk_block_scan(int value, int *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = value;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFFu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < kTopkWarps ? scratch[lane] : 0;
#pragma unroll
        for (int d = 1; d < kTopkWarps; d <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFFu, w, d);
            if (lane >= d) w += y;
        }
        __syncwarp();
        if (lane < kTopkWarps) scratch[lane] = w;
    }
    __syncthreads();
    const int before = warp > 0 ? scratch[warp - 1] : 0;
    __syncthreads();
    return before + x - value;
}

// ---- kernels ----

/* T: score element type; I: index type of out (int32_t or int64_t). */
template <typename T, typename I>
static __global__ void __launch_bounds__(kTopkThreads)
    topk_index_kernel(const ragvit_topk_index_args a) {
    cuda_pdl_wait();                     /* first: see cuda_util.cuh */
    extern __shared__ uint32_t keys_s[]; /* key of column prefix + i at topk_slot(i) */
    __shared__ int hist_s[1 << kTopkRadixBits];
    __shared__ int scan_s[kTopkWarps];
    __shared__ int select_s[2]; /* chosen digit, ties of it still to keep */
    const int tid = threadIdx.x;
    const int prefix = (int)a.prefix, k = (int)a.k, n = (int)a.cols - prefix;
    const int chunk = (n + kTopkThreads - 1) / kTopkThreads;
    for (int64_t b = blockIdx.x; b < a.batch; b += gridDim.x) {
        I *out = static_cast<I *>(a.out) + b * a.out_stride_b;
        for (int j = tid; j < prefix; j += kTopkThreads) out[j] = (I)j;
        if (k == 0) /* k and n are uniform over the grid: no barrier diverges */
            continue;
        if (k == n) {
            for (int i = tid; i < n; i += kTopkThreads) out[prefix + i] = (I)(prefix + i);
            continue;
        }
        const T *row = static_cast<const T *>(a.scores) + b * a.scores_stride_b + prefix;
        __syncthreads(); /* the previous row's compaction has read keys_s */
        for (int i = tid; i < n; i += kTopkThreads)
            keys_s[topk_slot(i)] = topk_key(elem_load(row + i));

        /* Radix select, most significant digit first: keep the candidates whose
         * key starts with `want` (under `mask`); `need` of them are still to be
         * kept. Invariant: 1 <= need <= candidates, so exactly one bin holds
         * the need-th largest candidate. */
        uint32_t want = 0, mask = 0;
        int need = k;
        for (int shift = 32 - kTopkRadixBits; shift >= 0; shift -= kTopkRadixBits) {
            hist_s[tid] = 0;
            __syncthreads();
            for (int i = tid; i < n; i += kTopkThreads) {
                const uint32_t key = keys_s[topk_slot(i)];
                if ((key & mask) == want) atomicAdd(&hist_s[(key >> shift) & 0xFFu], 1);
            }
            __syncthreads();
            const int digit = kTopkThreads - 1 - tid; /* thread 0 owns the largest digit */
            const int count = hist_s[digit];
            const int above = topk_block_scan(count, scan_s); /* candidates in larger bins */
            if (above < need && need <= above + count) {
                select_s[0] = digit;
                select_s[1] = need - above;
            }
            __syncthreads();
            want |= (uint32_t)select_s[0] << shift;
            mask |= 0xFFu << shift;
            need = select_s[1];
        }
        /* want is now the k-th largest key: keep every larger key and the first
         * `need` (lowest columns) of the keys equal to it. */

        const int lo = min(n, tid * chunk), hi = min(n, lo + chunk);
        int greater = 0, equal = 0;
        for (int i = lo; i < hi; i++) {
            const uint32_t key = keys_s[topk_slot(i)];
            greater += key > want;
            equal += key == want;
        }
        const int equal_before = topk_block_scan(equal, scan_s);
        const int ties = min(max(need - equal_before, 0), equal);
        I *dst = out + prefix + topk_block_scan(greater + ties, scan_s);
        int tie_rank = equal_before;
        for (int i = lo; i < hi; i++) {
            const uint32_t key = keys_s[topk_slot(i)];
            bool is_kept = key > want;
            if (key == want) is_kept = tie_rank++ < need;
            if (is_kept) *dst++ = (I)(prefix + i);
        }
    }
}

// ---- launcher ----

template <typename T, typename I>
static ragvit_status topk_index_launch(const ragvit_topk_index_args *a,
                                       const ragvit_device_info *dev, cudaStream_t stream) {
    const int n = (int)(a->cols - a->prefix);
    /* the k == 0 and k == n rows never touch keys_s */
    const size_t smem = (a->k == 0 || a->k == n) ? 0 : (size_t)topk_slot(n) * sizeof(uint32_t);
    const unsigned grid = (unsigned)(a->batch < INT32_MAX ? a->batch : INT32_MAX);
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_SEGMENT, topk_index_kernel<T, I>, grid, kTopkThreads, smem,
                         stream, *a));
    return RAGVIT_STATUS_OK;
}

template <typename T>
static ragvit_status topk_index_dispatch_out(const ragvit_topk_index_args *a,
                                             const ragvit_device_info *dev, cudaStream_t stream) {
    if (a->out_dtype == RAGVIT_DTYPE_I32) return topk_index_launch<T, int32_t>(a, dev, stream);
    if (a->out_dtype == RAGVIT_DTYPE_I64) return topk_index_launch<T, int64_t>(a, dev, stream);
    return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                       "topk_index: out must be int32 or int64, got dtype code %d",
                       (int)a->out_dtype);
}

extern "C" ragvit_status ragvit_cuda_topk_index(const ragvit_topk_index_args *a,
                                                const ragvit_device_info *dev, void *stream) {
    if (a->batch <= 0 || a->prefix + a->k <= 0) return RAGVIT_STATUS_OK;
    if (a->cols > RAGVIT_TOPK_MAX_COLS || a->prefix < 0 || a->k < 0 || a->prefix + a->k > a->cols)
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "topk_index: scores must have L <= %d and 0 <= prefix, k with prefix "
                           "+ k <= L, got L=%lld, prefix=%lld, k=%lld",
                           RAGVIT_TOPK_MAX_COLS, (long long)a->cols, (long long)a->prefix,
                           (long long)a->k);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: return topk_index_dispatch_out<__half>(a, dev, s);
    case RAGVIT_DTYPE_BF16: return topk_index_dispatch_out<__nv_bfloat16>(a, dev, s);
    case RAGVIT_DTYPE_F32: return topk_index_dispatch_out<float>(a, dev, s);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "topk_index: scores must be float16, bfloat16 or float32, got dtype "
                           "code %d",
                           (int)a->dtype);
    }
}
