/* attention.cuh — what the attention paths share (internal to csrc/kernels/attention*.cu):
 * q, k, v, out (T, H, D) with the head dim contiguous, cu_seqlens (S+1,) int32. Every path's
 * grid = (query tiles, H, min(S, 65535)); this header sizes it, bounds each sequence, and
 * holds the fp16/bf16 element traits and cp.async helpers of the tensor-core paths and the
 * declarations of each path's supports / plan / launch / init. Decision: helpers are static
 * inline (each TU inlines its own copy; kernel SASS does not depend on the file they sit in),
 * the cross-file functions are hidden (ATTENTION_INTERNAL): the module does not export them.
 * Covered by tests/test_attention.py and dev/test_attention.cu. */
#ifndef RAGVIT_ATTENTION_CUH
#define RAGVIT_ATTENTION_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda_util.cuh"

#define ATTENTION_LOG2E 1.4426950408889634f
#define ATTENTION_MAX_GRID_YZ 65535  /* gridDim.y and .z limit */
#define ATTENTION_MMA_MAX_HEADS 1024 /* mma.sync cls_attn keeps 8 bytes a head in shared memory */
#define ATTENTION_WGMMA_MAX_STAGES 5 /* (K, V) tile pairs in the wgmma ring */

/* Functions one attention file defines and another calls: not exported from the module. */
#define ATTENTION_INTERNAL __attribute__((visibility("hidden")))

// ---- grid sizing (host) ----

/* Query-tile blocks along x of a (grid_x, grid_y, grid_z) attention grid with `rows` query
 * rows a block: a loose max_seqlen (CUDA's default is T) must not launch millions of empty
 * blocks, so the grid is capped near twice the real work (T / rows + S query tiles per y,
 * at least 64 blocks an SM) and blocks loop over the remaining query tiles. */
static inline int64_t attention_cap_grid_x(int64_t grid_x, int64_t grid_y, int64_t grid_z,
                                           int64_t total_tokens, int64_t num_seqs, int64_t rows,
                                           int64_t sm_count) {
    int64_t budget = 2 * (total_tokens / rows + num_seqs) * grid_y;
    if (budget < 64 * sm_count) budget = 64 * sm_count;
    if (grid_x * grid_y * grid_z > budget) {
        grid_x = budget / (grid_y * grid_z);
        if (grid_x < 1) grid_x = 1;
    }
    return grid_x;
}

/* The grid's sequence-length bound: max_seqlen (default T) clamped to [1, INT32_MAX]. It
 * only sizes the grid; a sequence longer than it is skipped and flagged by the kernels. */
static inline int64_t attention_max_len(const ragvit_attention_args *a) {
    int64_t max_len = a->max_seqlen > 0 ? a->max_seqlen : a->total_tokens;
    if (max_len > INT32_MAX) max_len = INT32_MAX;
    return max_len < 1 ? 1 : max_len;
}

// ---- device helpers ----

static __device__ __forceinline__ uint32_t attention_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; is_valid == false writes 16 zero bytes and reads nothing. */
static __device__ __forceinline__ void attention_cp_async16(uint32_t dst, const void *src,
                                                            bool is_valid) {
    const int src_bytes = is_valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
                 : "memory");
}

static __device__ __forceinline__ void attention_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are still in flight. */
template <int N> static __device__ __forceinline__ void attention_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* 2^x (ex2.approx.ftz: what exp2f becomes under --use_fast_math; 2^-inf = 0). */
static __device__ __forceinline__ float attention_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Runtime form of cp.async.wait_group for ring depths up to 8. */
static __device__ __forceinline__ void attention_cp_async_wait_pending(int n) {
    switch (n) {
    case 0: attention_cp_async_wait<0>(); break;
    case 1: attention_cp_async_wait<1>(); break;
    case 2: attention_cp_async_wait<2>(); break;
    case 3: attention_cp_async_wait<3>(); break;
    case 4: attention_cp_async_wait<4>(); break;
    case 5: attention_cp_async_wait<5>(); break;
    default: attention_cp_async_wait<6>(); break;
    }
}

/* Per-dtype pieces: pack two floats (lower column in the low half), unpack, and
 * c[0..3] += A (16x16, row) * B (16x8, col) with fp32 accumulators. */
template <typename Elem> struct attention_elem;

template <> struct attention_elem<__half> {
    static constexpr bool is_half = true; /* the instructions' .f16 (else .bf16) type */
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        const __half2 h = __floats2half2_rn(lo, hi);
        uint32_t u;
        memcpy(&u, &h, sizeof u);
        return u;
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __half2 h;
        memcpy(&h, &u, sizeof u);
        return __half22float2(h);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <> struct attention_elem<__nv_bfloat16> {
    static constexpr bool is_half = false;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        uint32_t u;
        memcpy(&u, &h, sizeof u);
        return u;
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __nv_bfloat162 h;
        memcpy(&h, &u, sizeof u);
        return __bfloat1622float2(h);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* Sequence s's first token (start) and length (len) from cu_seqlens; false, and the error
 * flag raised by thread 0 of block (0, 0, .), when its bounds are bad (start < 0, end <
 * start, end past total_tokens) or its length exceeds max_len (the grid was sized from it):
 * such a sequence is skipped, its output rows untouched. Uniform across the block. */
static __device__ __forceinline__ bool attention_seq_bounds(const ragvit_attention_args &a, int s,
                                                            int h, int max_len, int &start,
                                                            int &len) {
    start = __ldg(a.cu_seqlens + s);
    const int end = __ldg(a.cu_seqlens + s + 1);
    const bool is_bad = start < 0 || end < start || (int64_t)end > a.total_tokens;
    if (is_bad || end - start > max_len) {
        if (blockIdx.x == 0 && h == 0 && threadIdx.x == 0 && a.error_flag != NULL)
            atomicOr(a.error_flag,
                     is_bad ? RAGVIT_ERROR_BAD_CU_SEQLENS : RAGVIT_ERROR_SEQLEN_OVER_MAX);
        return false;
    }
    len = end - start;
    return true;
}

// ---- the paths (attention.cu picks one) ----

/* fp32 FMA path (attention_fma.cu): any dtype, layout and listed head_dim; also runs the
 * cls_attn kernel when a->cls_attn is set. */
ATTENTION_INTERNAL ragvit_status attention_fma_launch(const ragvit_attention_args *a,
                                                      const ragvit_device_info *dev,
                                                      cudaStream_t stream);

/* mma.sync path (attention_mma.cu). Launch shape: warps per block (16 query rows each), K/V
 * ring stages, the grid's length bound, grid, smem bytes. */
typedef struct {
    int num_warps;
    int num_stages;
    int max_len;
    int smem_bytes;
    dim3 grid;
} attention_mma_plan;

ATTENTION_INTERNAL bool attention_mma_supports(const ragvit_attention_args *a,
                                               const ragvit_device_info *dev);
/* The launcher's plan; num_warps (1-4) / num_stages (2-4) > 0 force a value. */
ATTENTION_INTERNAL attention_mma_plan attention_mma_make_plan(const ragvit_attention_args *a,
                                                              const ragvit_device_info *dev,
                                                              int num_warps, int num_stages);
ATTENTION_INTERNAL ragvit_status attention_mma_launch_plan(const ragvit_attention_args *a,
                                                           const attention_mma_plan *plan,
                                                           const ragvit_device_info *dev,
                                                           cudaStream_t stream);
ATTENTION_INTERNAL ragvit_status attention_mma_launch(const ragvit_attention_args *a,
                                                      const ragvit_device_info *dev,
                                                      cudaStream_t stream);
ATTENTION_INTERNAL ragvit_status attention_mma_init(const ragvit_device_info *dev);

#ifdef RAGVIT_HAS_SM90A
/* wgmma path (attention_wgmma.cu, built only for sm_90a: present only with RAGVIT_HAS_SM90A). */
ATTENTION_INTERNAL bool attention_wgmma_supports(const ragvit_attention_args *a,
                                                 const ragvit_device_info *dev);
/* keys 64 or 128, num_stages 2-5 (0: the launcher's choice); tma 1 where the layout allows, 0
 * never, -1 the launcher's choice. attention_wgmma_launch is (0, 0, -1). */
ATTENTION_INTERNAL ragvit_status attention_wgmma_launch_plan(const ragvit_attention_args *a,
                                                             const ragvit_device_info *dev,
                                                             int keys, int num_stages, int tma,
                                                             cudaStream_t stream);
ATTENTION_INTERNAL ragvit_status attention_wgmma_launch(const ragvit_attention_args *a,
                                                        const ragvit_device_info *dev,
                                                        cudaStream_t stream);
ATTENTION_INTERNAL ragvit_status attention_wgmma_init(const ragvit_device_info *dev);
#endif

/* One-time per-device setup (attention.cu), called by ragvit_cuda_device_init. */
extern "C" ATTENTION_INTERNAL ragvit_status attention_init(const ragvit_device_info *dev);

#endif /* RAGVIT_ATTENTION_CUH */
