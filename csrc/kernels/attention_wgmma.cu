/* attention_wgmma.cu — the Hopper path (sm_90a, cc 9.0 devices): fp16/bf16 q, k, v, out
 * (T, H, D) with D = 64, neither cls_attn nor bias. grid = (query tiles of 64, H, min(S,
 * 65535)), one warpgroup (128 threads) a block; Q and K/V tiles of 64 (or 128) keys in
 * 128-byte swizzled shared memory, filled by cp.async (whole tiles past 256 tokens by TMA)
 * through a ring of 2-5 stages; S = Q K^T and O += P V by wgmma with fp32 accumulators.
 * Decision: the file is built for sm_90a alone (setup.py), so no other target carries stubs
 * of its kernels; attention.cu calls it only when RAGVIT_HAS_SM90A says it was built.
 * Covered by tests/test_attention.py and dev/test_attention.cu. */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <type_traits>

#include "attention.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_wgmma.cu holds sm_90a instructions: build it for sm_90a only (see setup.py)"
#endif

#define ATTENTION_WGMMA_ROWS 64   /* query rows per block (one warpgroup) */
#define ATTENTION_WGMMA_TILE 8192 /* bytes of one 64 x 64 16-bit tile (Q) */
#define ATTENTION_WGMMA_TAIL 8    /* most keys a 64-key step takes on (see the tile) */
#define ATTENTION_WGMMA_THIN 8    /* most rows of a thin last query tile (see it) */

/* Blocks an SM the kernel with `keys`-key tiles is compiled for: 5 (<= 96 registers, 2-4%
 * over 4) with 64 keys; 3 with 128 (137 registers; two stages of 32 KB fit 3 an SM). */
static constexpr int attention_wgmma_min_blocks(int keys) { return keys == 64 ? 5 : 3; }

/* Shared memory of a plan: alignment slack, Q, num_stages (V, K) pairs of keys-row tiles
 * (128 bytes a row), then with 64-key tiles the folded tail's 8 K rows and 16 V rows (see
 * the tile) and room for an 8-byte mbarrier a stage (TMA): 43 KB with 2 stages, 5 blocks an
 * SM. */
static int attention_wgmma_smem_bytes(int keys, int num_stages) {
    return 1024 + ATTENTION_WGMMA_TILE + 2 * 128 * keys * num_stages +
           (keys == 64 ? 128 * (ATTENTION_WGMMA_TAIL + 16) + 64 : 0);
}

/* Sequences longer than this take whole K/V tiles by TMA (see the launcher). */
#define ATTENTION_WGMMA_TMA_MIN_LEN 257

/* TMA descriptors of K and V as (64, heads, tokens) tensors with 64 x 1 x 64 boxes in the
 * 128-byte swizzle: the kernel parameter of the TMA kernels (the others take an empty one). */
struct attention_wgmma_maps {
    CUtensorMap k;
    CUtensorMap v;
};
struct attention_wgmma_no_maps {};
template <bool tma>
using attention_wgmma_maps_t =
    std::conditional_t<tma, attention_wgmma_maps, attention_wgmma_no_maps>;

// ---- device helpers ----

/* 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets
 * (all >> 4), 128-byte swizzle (layout type 1 in bits 62-63). */
static __device__ __forceinline__ uint64_t attention_wgmma_desc(uint32_t addr, uint32_t lbo_bytes,
                                                                uint32_t sbo_bytes) {
    return (uint64_t)((addr >> 4) & 0x3FFFu) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo_bytes >> 4) & 0x3FFFu) << 32) | ((uint64_t)1 << 62);
}

static __device__ __forceinline__ void attention_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void attention_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until every wgmma group this warpgroup committed has completed. */
static __device__ __forceinline__ void attention_wgmma_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

/* cp.async writes reach wgmma (the async proxy) only through this fence. */
static __device__ __forceinline__ void attention_wgmma_fence_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Shared address of stage 0's mbarrier (TMA; stage s's at + 8 s): past Q, the ring of
 * num_stages (V, K) slots and the folded tail's rows (attention_wgmma_smem_bytes). */
static __device__ __forceinline__ uint32_t attention_wgmma_bars(uint32_t smem, int keys,
                                                                int num_stages) {
    return smem + ATTENTION_WGMMA_TILE + 256 * keys * num_stages +
           128 * (ATTENTION_WGMMA_TAIL + 16);
}

static __device__ __forceinline__ void attention_wgmma_mbar_init(uint32_t bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ void attention_wgmma_mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void attention_wgmma_mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/* Box (0, h, row) of the tensor map into shared memory at dst, completing on bar. */
static __device__ __forceinline__ void
attention_wgmma_tma_load(uint32_t dst, const CUtensorMap *map, int h, int row, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(h), "r"(row), "r"(bar)
                 : "memory");
}

/* Keeps the compiler from moving accumulator accesses across an asynchronous wgmma. */
template <int N> static __device__ __forceinline__ void attention_wgmma_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define ATTENTION_WGMMA_D                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "       \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTENTION_WGMMA_OUT(d)                                                                     \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),            \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

/* scale-d is a predicate set from operand %n (the one after the accumulators): 1 accumulates
 * (d += A B), 0 overwrites (d = A B). */
#define ATTENTION_WGMMA_PRED(n) "{\n.reg .pred p;\nsetp.ne.b32 p, %" #n ", 0;\n"

/* The same for 64 accumulators (m64n128: operands %0-%63). */
#define ATTENTION_WGMMA_D128                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "       \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "        \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "        \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define ATTENTION_WGMMA_OUT128(d)                                                                  \
    ATTENTION_WGMMA_OUT(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),       \
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), \
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), \
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* The body of a wgmma with both operands by descriptor (a, b) into accumulators d, shape
 * m64{n}k16, in Elem's type (.atype/.btype): PRED sets p from scale-d (`accumulate`), D lists
 * the accumulator operands, OUT binds them, AB names the descriptor operands. */
#define ATTENTION_WGMMA_SS(n, PRED, D, OUT, AB)                                                    \
    do {                                                                                           \
        if constexpr (attention_elem<Elem>::is_half)                                               \
            asm volatile(PRED "wgmma.mma_async.sync.aligned.m64" n "k16.f32.f16.f16 " D ", " AB    \
                              ", p, 1, 1, 0, 0;\n}\n"                                              \
                         : OUT(d)                                                                  \
                         : "r"(accumulate), "l"(a), "l"(b));                                       \
        else                                                                                       \
            asm volatile(PRED "wgmma.mma_async.sync.aligned.m64" n "k16.f32.bf16.bf16 " D ", " AB  \
                              ", p, 1, 1, 0, 0;\n}\n"                                              \
                         : OUT(d)                                                                  \
                         : "r"(accumulate), "l"(a), "l"(b));                                       \
    } while (0)

/* d (64 x 64, fp32) = A (64 x 16, shared, K-major) * B (16 x 64, shared, K-major), plus d
 * when accumulate != 0. */
template <typename Elem>
static __device__ __forceinline__ void attention_wgmma_ss(float (&d)[32], uint64_t a, uint64_t b,
                                                          int accumulate) {
    ATTENTION_WGMMA_SS("n64", ATTENTION_WGMMA_PRED(32), ATTENTION_WGMMA_D, ATTENTION_WGMMA_OUT,
                       "%33, %34");
}

/* d (64 x 128, fp32) = A (64 x 16, shared, K-major) * B (16 x 128, shared, K-major), plus d
 * when accumulate != 0. */
template <typename Elem>
static __device__ __forceinline__ void attention_wgmma_ss(float (&d)[64], uint64_t a, uint64_t b,
                                                          int accumulate) {
    ATTENTION_WGMMA_SS("n128", ATTENTION_WGMMA_PRED(64), ATTENTION_WGMMA_D128,
                       ATTENTION_WGMMA_OUT128, "%65, %66");
}

/* The same for 36 accumulators (m64n72: operands %0-%35). */
#define ATTENTION_WGMMA_D36                                                                        \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "       \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}"
#define ATTENTION_WGMMA_OUT36(d)                                                                   \
    ATTENTION_WGMMA_OUT(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])

/* d (64 x 72, fp32) = A (64 x 16, shared, K-major) * B (16 x 72, shared, K-major), plus d
 * when accumulate != 0. */
template <typename Elem>
static __device__ __forceinline__ void attention_wgmma_ss(float (&d)[36], uint64_t a, uint64_t b,
                                                          int accumulate) {
    ATTENTION_WGMMA_SS("n72", ATTENTION_WGMMA_PRED(36), ATTENTION_WGMMA_D36, ATTENTION_WGMMA_OUT36,
                       "%37, %38");
}

/* d (64 x 64, fp32) += A (64 x 16, registers: this warp's 16 rows as mma.m16n8k16's A
 * fragment) * B (16 x 64, shared, MN-major: imm-trans-b = 1). */
template <typename Elem>
static __device__ __forceinline__ void attention_wgmma_rs(float (&d)[32], const uint32_t (&a)[4],
                                                          uint64_t b) {
    if constexpr (attention_elem<Elem>::is_half) /* .atype/.btype */
        asm volatile(ATTENTION_WGMMA_PRED(
                         32) "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " ATTENTION_WGMMA_D
                             ", {%33, %34, %35, %36}, %37, p, 1, 1, 1;\n}\n"
                     : ATTENTION_WGMMA_OUT(d)
                     : "r"(1), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile(
            ATTENTION_WGMMA_PRED(
                32) "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATTENTION_WGMMA_D
                    ", {%33, %34, %35, %36}, %37, p, 1, 1, 1;\n}\n"
            : ATTENTION_WGMMA_OUT(d)
            : "r"(1), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

/* 64 rows of 64 elements (src row r at src + r * stride) into a 1024-byte aligned tile at
 * shared address dst in the 128-byte swizzle wgmma reads (16-byte chunk c of row r at chunk
 * c ^ (r % 8)); rows >= valid_rows are zero-filled and read nothing. */
template <typename Elem>
static __device__ __forceinline__ void attention_wgmma_load_tile(uint32_t dst, const Elem *src,
                                                                 int64_t stride, int valid_rows) {
#pragma unroll
    for (int i = 0; i < 4; ++i) { /* 512 chunks of 16 bytes, 4 a thread */
        const int c = threadIdx.x + 128 * i;
        const int r = c >> 3, col = c & 7;
        const bool is_valid = r < valid_rows;
        const Elem *g = src + (is_valid ? (int64_t)r * stride : (int64_t)0) + col * 8;
        attention_cp_async16(dst + r * 128 + ((col ^ (r & 7)) << 4), g, is_valid);
    }
}

/* Online softmax of one 64 x keys score tile s in place (s becomes P = 2^(s scale_log2 - m),
 * keys >= num_keys masked to 0); updates the row maxima and sums of this thread's two rows
 * and returns their rescale factors 2^(old max - new max) in alpha (1 on the first tile).
 * Thread (group, tig) of warp w holds rows 16 w + group (s[4i], s[4i + 1]) and + 8
 * (s[4i + 2], s[4i + 3]), keys 8 i + 2 tig + {0, 1}. */
template <int keys>
static __device__ __forceinline__ void
attention_wgmma_softmax(float (&s)[keys / 2], int num_keys, float scale_log2, bool is_first,
                        float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2]) {
    const int tig = (threadIdx.x & 31) & 3;
    if (num_keys < keys) {
#pragma unroll
        for (int i = 0; i < keys / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (i * 8 + 2 * tig + (e & 1) >= num_keys) s[4 * i + e] = -INFINITY;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < keys / 8; ++i) {
        mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        /* the tile's first key is valid: the maximum is finite; scale_log2 > 0 commutes */
        const float m = is_first ? mx[r] * scale_log2 : fmaxf(row_max[r], mx[r] * scale_log2);
        alpha[r] = is_first ? 1.0f : attention_exp2(row_max[r] - m);
        row_max[r] = m;
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < keys / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            s[4 * i + e] = attention_exp2(fmaf(s[4 * i + e], scale_log2, -row_max[r]));
            sum[r] += s[4 * i + e];
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] = is_first ? sum[r] : fmaf(row_sum[r], alpha[r], sum[r]);
}

/* S = Q K^T over a K tile of N / 2 keys, then waits for it. */
template <typename Elem, int N>
static __device__ __forceinline__ void attention_wgmma_scores(float (&s)[N], uint64_t desc_q,
                                                              uint64_t desc_k) {
    attention_wgmma_fence_regs(s);
    attention_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) /* columns [16 kk, 16 kk + 16) of Q and K: 32 bytes on */
        attention_wgmma_ss<Elem>(s, desc_q + 2 * kk, desc_k + 2 * kk, kk);
    attention_wgmma_commit();
    attention_wgmma_wait_all();
    attention_wgmma_fence_regs(s);
}

/* O += P V over `steps` 16-key steps of V (MN-major, 2048 bytes a step): steps below
 * `split` from the tile at desc_v, the rest from the tile at desc_x; then waits for it. */
template <typename Elem, int steps, int split>
static __device__ __forceinline__ void attention_wgmma_pv(float (&o)[32],
                                                          const uint32_t (&p)[steps][4],
                                                          uint64_t desc_v, uint64_t desc_x) {
    attention_wgmma_fence_regs(o);
    attention_wgmma_fence();
#pragma unroll
    for (int jj = 0; jj < steps; ++jj)
        attention_wgmma_rs<Elem>(o, p[jj],
                                 jj < split ? desc_v + (uint64_t)(128 * jj)
                                            : desc_x + (uint64_t)(128 * (jj - split)));
    attention_wgmma_commit();
    attention_wgmma_wait_all();
    attention_wgmma_fence_regs(o);
}

/* P (the softmax's output s: N fp32 C-fragment values, N / 4 key blocks of 8) as the A
 * fragments of P V in Elem: k-step jj is keys [16 jj, 16 jj + 16), the C fragments of key
 * blocks 2 jj and 2 jj + 1 (zeros past the last block). */
template <typename Elem, int steps, int N>
static __device__ __forceinline__ void attention_wgmma_pack(uint32_t (&p)[steps][4],
                                                            const float (&s)[N]) {
    using ops = attention_elem<Elem>;
    static_assert(N <= 8 * steps && N > 8 * steps - 8 && N % 4 == 0, "whole key blocks");
#pragma unroll
    for (int jj = 0; jj < steps; ++jj) {
        p[jj][0] = ops::pack(s[8 * jj], s[8 * jj + 1]);
        p[jj][1] = ops::pack(s[8 * jj + 2], s[8 * jj + 3]);
        p[jj][2] = 8 * jj + 4 < N ? ops::pack(s[8 * jj + 4], s[8 * jj + 5]) : 0u;
        p[jj][3] = 8 * jj + 4 < N ? ops::pack(s[8 * jj + 6], s[8 * jj + 7]) : 0u;
    }
}

/* One 64-row query tile of head h of the sequence starting at token `start` over key tiles
 * of `keys` keys (the block is one warpgroup; every branch is block-uniform). smem:
 * 1024-byte aligned shared address: Q, num_stages (V, K) slot pairs, the folded tail's. */
template <typename Elem, int keys, bool tma>
static __device__ __forceinline__ void
attention_wgmma_tile(uint32_t smem, int num_stages, const ragvit_attention_args &a,
                     const attention_wgmma_maps_t<tma> &maps, uint32_t &phases, int start, int h,
                     int q0, int len, float scale_log2) {
    using ops = attention_elem<Elem>;
    constexpr uint32_t kTile = 128 * keys; /* bytes of a K or V tile */
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int group = lane >> 2, tig = lane & 3;
    /* A sequence whose last key tile would hold 1 .. kTail keys (197 tokens: 5, 577: 1)
     * folds them into the step before: one step over keys + kTail keys, one step fewer. */
    constexpr int kTail = ATTENTION_WGMMA_TAIL;
    constexpr int kWide = keys == 64 ? keys + kTail : keys; /* keys of that step */
    const int tail = len % keys;
    const bool has_tail = keys == 64 && len > keys && tail > 0 && tail <= kTail;
    const int num_tiles = (len + keys - 1) / keys - (has_tail ? 1 : 0);
    /* Key tile t sits in ring slot (first_stage + t) % num_stages; with a folded tail the
     * last one sits in the last slot, so the tail's K rows land right after its K tile, in
     * the kTail + 16 rows past the ring (s_x: K rows, then a 16-row V tile), which nothing
     * else uses. (Without one, slot 0: the division cost 2-5% on sequences of 1-2 tiles.) */
    const int first_stage = has_tail ? (num_stages - num_tiles % num_stages) % num_stages : 0;
    const uint32_t s_q = smem, s_kv = smem + ATTENTION_WGMMA_TILE;
    const uint32_t s_x = s_kv + 2 * kTile * num_stages;
    const uint32_t s_bar = attention_wgmma_bars(smem, keys, num_stages); /* with tma */
    const Elem *k_seq = static_cast<const Elem *>(a.k) + (int64_t)h * a.k_stride_head +
                        (int64_t)start * a.k_stride_token;
    const Elem *v_seq = static_cast<const Elem *>(a.v) + (int64_t)h * a.v_stride_head +
                        (int64_t)start * a.v_stride_token;
    /* This thread's 16-byte chunks of a K or V tile: column cc of rows cr + 16 i (i < keys /
     * 16), at shared offset off + 2048 i ((cr + 16 i) & 7 == cr & 7: one swizzle for all). Key
     * tiles load in order, so running pointers to row cr of the next tile replace the
     * per-tile 64-bit index arithmetic (the loads' address math was a quarter of the loop's
     * instructions). */
    const int cr = threadIdx.x >> 3, cc = threadIdx.x & 7;
    const uint32_t off = cr * 128 + ((cc ^ (cr & 7)) << 4);
    const char *k_next = reinterpret_cast<const char *>(k_seq + cc * 8);
    const char *v_next = reinterpret_cast<const char *>(v_seq + cc * 8);
    const int64_t k_rows16 = 16 * a.k_stride_token * (int64_t)sizeof(Elem);
    const int64_t v_rows16 = 16 * a.v_stride_token * (int64_t)sizeof(Elem);
    k_next += (k_rows16 >> 4) * cr;
    v_next += (v_rows16 >> 4) * cr;
    int rows_left = len - cr; /* chunk i of the next tile holds a key iff 16 i < rows_left */
    int tiles_loaded = 0;
    /* the next key tile into ring stage `stage` (V, then K), and after the last tile of a
     * folded sequence its tail; rows past the sequence are zero-filled, their address
     * clamped to the sequence's first row */
    auto load_kv = [&](int stage) {
        if constexpr (tma) {
            const uint32_t s_slot = s_kv + 2 * kTile * stage;
            const int row0 = keys * tiles_loaded;
            if (row0 + keys <= len) { /* a whole tile: TMA */
                if (threadIdx.x == 0) {
                    const uint32_t bar = s_bar + 8 * stage;
                    attention_wgmma_mbar_expect(bar, 2 * kTile);
                    attention_wgmma_tma_load(s_slot + kTile, &maps.k, h, start + row0, bar);
                    attention_wgmma_tma_load(s_slot, &maps.v, h, start + row0, bar);
                }
            } else {
                /* the last, partial tile: cp.async, rows past the sequence zero-filled. Kept
                 * apart from the cp.async path below (its running pointers): one shared path
                 * measured 1.5-4% slower on 577-token rows (docs/experiments.md). */
#pragma unroll
                for (int i = 0; i < keys / 16; ++i) {
                    const int key = row0 + cr + 16 * i;
                    const bool is_valid = key < len;
                    const int64_t kr = is_valid ? key : 0;
                    attention_cp_async16(s_slot + kTile + 2048 * i + off,
                                         k_seq + kr * a.k_stride_token + cc * 8, is_valid);
                    attention_cp_async16(s_slot + 2048 * i + off,
                                         v_seq + kr * a.v_stride_token + cc * 8, is_valid);
                }
            }
            if (++tiles_loaded == num_tiles && has_tail) {
                const int key = keys * num_tiles + cr;
                const bool is_valid = key < len; /* the tail's row cr */
                const Elem *k = k_seq + (is_valid ? (int64_t)key * a.k_stride_token : 0) + cc * 8;
                const Elem *v = v_seq + (is_valid ? (int64_t)key * a.v_stride_token : 0) + cc * 8;
                if (cr < kTail) attention_cp_async16(s_x + off, k, is_valid);
                attention_cp_async16(s_x + 128 * kTail + off, v, is_valid);
            }
            return;
        }
        const uint32_t s_v = s_kv + 2 * kTile * stage + off; /* a slot: V, then K */
        const char *k = k_next, *v = v_next;
#pragma unroll
        for (int i = 0; i < keys / 16; ++i) {
            const bool is_valid = 16 * i < rows_left;
            attention_cp_async16(s_v + kTile + 2048 * i, is_valid ? (const void *)k : k_seq,
                                 is_valid);
            attention_cp_async16(s_v + 2048 * i, is_valid ? (const void *)v : v_seq, is_valid);
            k += k_rows16;
            v += v_rows16;
        }
        if (has_tail && ++tiles_loaded == num_tiles) {
            const bool is_valid = keys < rows_left; /* the tail's row cr */
            if (cr < kTail)
                attention_cp_async16(s_x + off, is_valid ? (const void *)k : k_seq, is_valid);
            attention_cp_async16(s_x + 128 * kTail + off, is_valid ? (const void *)v : v_seq,
                                 is_valid);
        }
        k_next = k;
        v_next = v;
        rows_left -= keys;
    };

    __syncthreads(); /* this block's previous tile may still read shared memory */
    attention_wgmma_load_tile<Elem>(s_q,
                                    static_cast<const Elem *>(a.q) +
                                        ((int64_t)start + q0) * a.q_stride_token +
                                        (int64_t)h * a.q_stride_head,
                                    a.q_stride_token, min(ATTENTION_WGMMA_ROWS, len - q0));
    /* key tiles loaded ahead of step 0: all of them when they fit the ring (every slot is
     * free after the barrier above), else num_stages - 1 (step t then refills tile t - 1's
     * slot after its own barrier); cp.async group g is key tile g either way */
    const int ahead = num_tiles <= num_stages ? num_stages : num_stages - 1;
    for (int st = 0; st < ahead; ++st) {
        if (st < num_tiles)
            load_kv(first_stage + st < num_stages ? first_stage + st
                                                  : first_stage + st - num_stages);
        attention_cp_async_commit(); /* group st: key tile st (+ Q), maybe empty */
    }

    float o[32], s[keys / 2];
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < keys / 2; ++i) s[i] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, alpha[2];
    uint32_t p[keys / 16][4];
    const uint64_t desc_q = attention_wgmma_desc(s_q, 16, 1024);
    /* One step over the key tile at desc_k / desc_v, `width` keys wide (2 x s_w's size):
     * `keys`, or kWide for a folded tail, whose kTail K rows follow the tile (it sits in the
     * last ring slot: they are s_x's, copied with it) and whose V rows at s_x + 128 kTail
     * make one more 16-key P V step (rows past the tail zero-filled, their P 0). S = Q K^T,
     * the online softmax, O rescaled, P as the A fragments of P V (k-step jj: keys [16 jj,
     * 16 jj + 16), the C fragments of key blocks 2 jj and 2 jj + 1), O += P V. */
    auto step = [&](auto &s_w, auto &p_w, uint64_t desc_k, uint64_t desc_v, int num_keys,
                    bool is_first) {
        constexpr int width = (int)(2 * sizeof(s_w) / sizeof(float));
        constexpr int steps = (int)(sizeof(p_w) / sizeof(p_w[0]));
        attention_wgmma_scores<Elem>(s_w, desc_q, desc_k);
        attention_wgmma_softmax<width>(s_w, num_keys, scale_log2, is_first, row_max, row_sum,
                                       alpha);
        if (!is_first) {
#pragma unroll
            for (int i = 0; i < 32; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
        attention_wgmma_pack<Elem>(p_w, s_w);
        attention_wgmma_pv<Elem, steps, keys / 16>(
            o, p_w, desc_v, attention_wgmma_desc(s_x + 128 * kTail, 2048, 1024));
    };
    /* the folded tail's step, with its own kWide-key S and P */
    auto tail_step = [&](uint64_t desc_k, uint64_t desc_v, int num_keys, bool is_first) {
        float sa[kWide / 2];
#pragma unroll
        for (int i = 0; i < kWide / 2; ++i) sa[i] = 0.0f;
        uint32_t pa[(kWide + 15) / 16][4]; /* keys 64-71, then zeros for 72-79 */
        step(sa, pa, desc_k, desc_v, num_keys, is_first);
    };
    int stage = first_stage;
    for (int t = 0; t < num_tiles; ++t) {
        const int num_keys = min(keys, len - t * keys);
        attention_cp_async_wait_pending(ahead - 1); /* tile t landed */
        if constexpr (tma) {
            if (num_keys == keys) { /* a whole tile came by TMA */
                attention_wgmma_mbar_wait(s_bar + 8 * stage, (phases >> stage) & 1u);
                phases ^= 1u << stage;
            }
        }
        attention_wgmma_fence_proxy();
        __syncthreads();           /* every thread's copies; tile t - 1 fully consumed */
        if (t + ahead < num_tiles) /* tile t + ahead, into tile t - 1's slot */
            load_kv(stage == 0 ? num_stages - 1 : stage - 1);
        attention_cp_async_commit(); /* group t + ahead, maybe empty */
        const uint32_t s_v = s_kv + 2 * kTile * stage, s_k = s_v + kTile;
        stage = stage + 1 == num_stages ? 0 : stage + 1;

        const uint64_t desc_k = attention_wgmma_desc(s_k, 16, 1024);
        const uint64_t desc_v = attention_wgmma_desc(s_v, kTile, 1024);
        if constexpr (keys == 64) {
            if (has_tail && t == num_tiles - 1) {
                tail_step(desc_k, desc_v, len - t * keys, t == 0);
                break;
            }
        }
        step(s, p, desc_k, desc_v, num_keys, t == 0);
    }
    attention_cp_async_wait<0>(); /* only empty groups can be left */

    float inv[2]; /* 1 / row sum over the quad that shares each row */
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        inv[r] = __fdividef(1.0f, row_sum[r]);
    }
    /* Staged through this warp's own 16 rows of the Q tile (its last reader, the final
     * Q K^T, has completed; the next tile's Q loads after the barrier that opens it), in the
     * tile's swizzle (conflict-free both ways), so the global stores are whole 16-byte
     * chunks: a warp's store covers four 128-byte rows instead of half of eight sectors. */
    const uint32_t s_o = s_q + 2048 * warp;
#pragma unroll
    for (int i = 0; i < 8; ++i) { /* columns 8 i + 2 tig, 16-byte chunk i of each row */
        const uint32_t lo = ops::pack(o[4 * i] * inv[0], o[4 * i + 1] * inv[0]);
        const uint32_t hi = ops::pack(o[4 * i + 2] * inv[1], o[4 * i + 3] * inv[1]);
        asm volatile(
            "st.shared.u32 [%0], %1;\n" ::"r"(s_o + group * 128 + ((i ^ group) << 4) + 4 * tig),
            "r"(lo)
            : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(s_o + (group + 8) * 128 +
                                                       ((i ^ group) << 4) + 4 * tig),
                     "r"(hi)
                     : "memory");
    }
    __syncwarp();
    Elem *out = static_cast<Elem *>(a.out) + (int64_t)h * a.out_stride_head;
    const int chunk = lane & 7;
#pragma unroll
    for (int j = 0; j < 4; ++j) { /* row (lane >> 3) + 4 j of the warp's 16, chunk `chunk` */
        const int r = (lane >> 3) + 4 * j;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(s_o + r * 128 + ((chunk ^ (r & 7)) << 4))
                     : "memory");
        const int row = q0 + 16 * warp + r;
        if (row < len)
            *reinterpret_cast<uint4 *>(out + ((int64_t)start + row) * a.out_stride_token +
                                       8 * chunk) = v;
    }
}

/* 16 elements from src (32-byte aligned, 16 t elements into a row) as 8 words (2 each). */
static __device__ __forceinline__ void attention_wgmma_words16(const void *src, uint32_t (&w)[8]) {
    const uint4 lo = static_cast<const uint4 *>(src)[0], hi = static_cast<const uint4 *>(src)[1];
    w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w;
    w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
}

/* A last query tile of 1 .. ATTENTION_WGMMA_THIN rows (rows q0 .. len - 1 of head h:
 * 577 tokens end in one of 1 row, 197 in one of 5) in a block of its own, on mma.sync
 * instead of a 64-row wgmma tile. Each warp takes 16-key chunks w, w + 4, ... transposed
 * (keys and head dims as the 16 rows, the 8 queries as the columns: nothing computed for
 * rows past the tile), operands loaded straight from global memory into registers:
 * S^T = K Q^T, an online softmax down each query column, P^T moved into the B layout by
 * movmatrix, O^T += V^T P^T; the warps' maxima, sums and partial O merge in shared memory
 * at the end. To load whole 16-byte chunks, head dims are permuted consistently (sums over
 * them are order-free): in Q K^T, thread t's 16 dims 16 t .. 16 t + 15 are its k-pairs of
 * the 4 k-steps (k-step kk: words 2 kk and 2 kk + 1); in P V, the output dims of rows g
 * and g + 8 of m-block i are 8 g + 2 i and 8 g + 2 i + 1, so thread (g, t) reads dims
 * 8 g .. 8 g + 7 of V rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9. Rows past the tile read zeros
 * and are never stored; keys past the sequence score -inf, their K row clamped to the
 * first, their V row zero (P 0 must not meet NaN). Why a block of its own: a 64-row tile
 * for such rows cost about a full tile's time (256 DeiT-B images of 197 tokens on an H200:
 * 165-171 us with it, 163-167 with this; docs/kernels/attention.md). A thin block is still
 * bound by its K and V reads, which it shares with the full tiles' nearly saturated L2 path.
 * smem: the block's shared memory (8.25 KB used). */
template <typename Elem>
static __device__ __forceinline__ void
attention_wgmma_thin_tile(unsigned char *smem, const ragvit_attention_args &a, int start, int h,
                          int q0, int len, float scale_log2) {
    using ops = attention_elem<Elem>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rows = len - q0;
    uint32_t qb[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u}; /* Q^T as B: query g, dims 16 t .. */
    if (g < rows)
        attention_wgmma_words16(static_cast<const Elem *>(a.q) +
                                    ((int64_t)start + q0 + g) * a.q_stride_token +
                                    (int64_t)h * a.q_stride_head + 16 * t,
                                qb);
    const Elem *k_head = static_cast<const Elem *>(a.k) + (int64_t)h * a.k_stride_head +
                         (int64_t)start * a.k_stride_token;
    const Elem *v_head = static_cast<const Elem *>(a.v) + (int64_t)h * a.v_stride_head +
                         (int64_t)start * a.v_stride_token;
    /* queries 2 t + e: running maxima (log2 units) and this thread's partial sums; O^T of
     * m-block i: o[i][e] at dim 8 g + 2 i, o[i][2 + e] at dim 8 g + 2 i + 1 */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;
    const int num_chunks = (len + 15) >> 4;
    for (int c = warp; c < num_chunks; c += 4) {
        const int key0 = 16 * c;
        uint32_t kw[2][8]; /* K rows key0 + g (+ 8): head dims 16 t .. 16 t + 15 */
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + g + 8 * r;
            attention_wgmma_words16(
                k_head + (int64_t)(key < len ? key : 0) * a.k_stride_token + 16 * t, kw[r]);
        }
        uint4 vr[4]; /* V rows key0 + 2 t + {0, 1, 8, 9}: head dims 8 g .. 8 g + 7 */
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int key = key0 + 2 * t + (j & 1) + 8 * (j >> 1);
            vr[j] = key < len ? *reinterpret_cast<const uint4 *>(
                                    v_head + (int64_t)key * a.v_stride_token + 8 * g)
                              : make_uint4(0u, 0u, 0u, 0u);
        }
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* S^T: keys g, g + 8 x queries 2 t, 2 t + 1 */
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint32_t af[4] = {kw[0][2 * kk], kw[1][2 * kk], kw[0][2 * kk + 1],
                                    kw[1][2 * kk + 1]};
            ops::mma(s, af, qb[2 * kk], qb[2 * kk + 1]);
        }
        if (key0 + g >= len) s[0] = s[1] = -INFINITY;
        if (key0 + g + 8 >= len) s[2] = s[3] = -INFINITY;
        float p[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) { /* key0 is valid: the chunk's maximum is finite */
            float mx = fmaxf(s[e], s[2 + e]);
#pragma unroll
            for (int lanes = 4; lanes < 32; lanes *= 2)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, lanes));
            const float m_new = fmaxf(m[e], mx * scale_log2);
            const float alpha = attention_exp2(m[e] - m_new); /* from -inf: 0 */
            p[e] = attention_exp2(fmaf(s[e], scale_log2, -m_new));
            p[2 + e] = attention_exp2(fmaf(s[2 + e], scale_log2, -m_new));
            l[e] = fmaf(l[e], alpha, p[e] + p[2 + e]);
            m[e] = m_new;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                o[i][e] *= alpha;
                o[i][2 + e] *= alpha;
            }
        }
        /* P^T (keys x queries, two 8 x 8 blocks) transposed: B's keys 2 t, 2 t + 1 (+ 8) */
        uint32_t pb[2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
            asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
                : "=r"(pb[r])
                : "r"(ops::pack(p[2 * r], p[2 * r + 1])));
        const uint32_t v0[4] = {vr[0].x, vr[0].y, vr[0].z, vr[0].w};
        const uint32_t v1[4] = {vr[1].x, vr[1].y, vr[1].z, vr[1].w};
        const uint32_t v2[4] = {vr[2].x, vr[2].y, vr[2].z, vr[2].w};
        const uint32_t v3[4] = {vr[3].x, vr[3].y, vr[3].z, vr[3].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { /* V^T rows 8 g + 2 i (+ 1) as A: keys low half first */
            const uint32_t af[4] = {
                __byte_perm(v0[i], v1[i], 0x5410), __byte_perm(v0[i], v1[i], 0x7632),
                __byte_perm(v2[i], v3[i], 0x5410), __byte_perm(v2[i], v3[i], 0x7632)};
            ops::mma(o[i], af, pb[0], pb[1]);
        }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int lanes = 4; lanes < 32; lanes *= 2)
            l[e] += __shfl_xor_sync(0xffffffffu, l[e], lanes);
    /* per warp: O (8 queries x 64 dims, fp32), then the maxima and sums (8 each) */
    float *s_o = reinterpret_cast<float *>(smem);
    float *s_ml = s_o + 4 * 8 * 64;
    __syncthreads(); /* this block's previous thin tile may still read shared memory */
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float *row = s_o + (warp * 8 + 2 * t + e) * 64 + 8 * g;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            *reinterpret_cast<float2 *>(row + 2 * i) = make_float2(o[i][e], o[i][2 + e]);
        if (g == 0) {
            s_ml[warp * 16 + 2 * t + e] = m[e];
            s_ml[warp * 16 + 8 + 2 * t + e] = l[e];
        }
    }
    __syncthreads();
    const int r = threadIdx.x >> 4, d = 4 * (threadIdx.x & 15); /* row r, dims d .. d + 3 */
    if (r < rows) {
        float mx = -INFINITY; /* warp 0 has key 0: finite */
#pragma unroll
        for (int w = 0; w < 4; ++w) mx = fmaxf(mx, s_ml[w * 16 + r]);
        float sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < 4; ++w) { /* a warp without keys: maximum -inf, weight 0 */
            const float weight = attention_exp2(s_ml[w * 16 + r] - mx);
            const float4 ow = *reinterpret_cast<const float4 *>(s_o + (w * 8 + r) * 64 + d);
            sum = fmaf(weight, s_ml[w * 16 + 8 + r], sum);
            acc[0] = fmaf(weight, ow.x, acc[0]);
            acc[1] = fmaf(weight, ow.y, acc[1]);
            acc[2] = fmaf(weight, ow.z, acc[2]);
            acc[3] = fmaf(weight, ow.w, acc[3]);
        }
        const float inv = __fdividef(1.0f, sum);
        Elem *out = static_cast<Elem *>(a.out) + (int64_t)h * a.out_stride_head +
                    ((int64_t)start + q0 + r) * a.out_stride_token + d;
        *reinterpret_cast<uint2 *>(out) = make_uint2(ops::pack(acc[0] * inv, acc[1] * inv),
                                                     ops::pack(acc[2] * inv, acc[3] * inv));
    }
}

// ---- kernels ----

/* Block (x, y, z): query tiles x, x + gridDim.x, ... of head y of sequences z, z + gridDim.z,
 * ...; a sequence with bad bounds or longer than max_len is skipped and flagged, as in the
 * mma.sync kernel. Blocks x == thin_x (the launcher sets it, >= 0, only when each query
 * tile has a block and that tile of every sequence is thin) run the thin tiles. */
template <typename Elem, int keys, bool tma>
static __global__ void __launch_bounds__(128, attention_wgmma_min_blocks(keys))
    attention_wgmma_kernel(const __grid_constant__ ragvit_attention_args a, int max_len,
                           int num_stages, int thin_x,
                           const __grid_constant__ attention_wgmma_maps_t<tma> maps) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    extern __shared__ __align__(16) unsigned char attention_wgmma_smem[];
    const uint32_t raw = attention_smem_addr(attention_wgmma_smem);
    const uint32_t smem = (raw + 1023u) & ~1023u; /* the swizzle needs 1024-byte tiles */
    const int h = blockIdx.y;
    const float scale_log2 = a.scale * ATTENTION_LOG2E;
    if constexpr (keys == 64) {
        /* the launcher's promise: every tile here is thin. A loop of its own: one tile call
         * choosing between the two paths in the loop below spilled at 96 registers */
        if ((int)blockIdx.x == thin_x) {
            const int q0 = thin_x * ATTENTION_WGMMA_ROWS;
            for (int s = blockIdx.z; s < a.num_seqs; s += gridDim.z) {
                int start, len;
                if (attention_seq_bounds(a, s, h, max_len, start, len) && q0 < len)
                    attention_wgmma_thin_tile<Elem>(attention_wgmma_smem + (smem - raw), a, start,
                                                    h, q0, len, scale_log2);
            }
            return;
        }
    }
    uint32_t phases = 0; /* bit s: the parity stage s's mbarrier completes next */
    if constexpr (tma) {
        if (threadIdx.x == 0) {
            const uint32_t s_bar = attention_wgmma_bars(smem, keys, num_stages);
            for (int st = 0; st < num_stages; ++st) attention_wgmma_mbar_init(s_bar + 8 * st);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.k))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.v))
                         : "memory");
        } /* the tile's opening barrier publishes the initialization */
    }
    for (int s = blockIdx.z; s < a.num_seqs; s += gridDim.z) {
        int start, len;
        if (!attention_seq_bounds(a, s, h, max_len, start, len)) continue;
        for (int q0 = blockIdx.x * ATTENTION_WGMMA_ROWS; q0 < len;
             q0 += gridDim.x * ATTENTION_WGMMA_ROWS)
            attention_wgmma_tile<Elem, keys, tma>(smem, num_stages, a, maps, phases, start, h, q0,
                                                  len, scale_log2);
    }
}

// ---- launcher ----

/* Whether this path runs these arguments (the caller checked attention_mma_supports: aligned
 * rows): fp16/bf16, D = 64, no cls_attn, no bias, a compute capability 9.0 device (the only
 * one this file's sm_90a code runs on) with room for the 2-stage plan. */
bool attention_wgmma_supports(const ragvit_attention_args *a, const ragvit_device_info *dev) {
    return dev != NULL && dev->cc_major == 9 && dev->cc_minor == 0 && a->head_dim == 64 &&
           a->cls_attn == NULL && a->bias == NULL &&
           (a->dtype == RAGVIT_DTYPE_F16 || a->dtype == RAGVIT_DTYPE_BF16) &&
           dev->smem_per_block_optin >= attention_wgmma_smem_bytes(64, 2);
}

/* cuTensorMapEncodeTiled from the driver, set by attention_wgmma_init (device init
 * runs under the GIL: never two writers); NULL: no TMA. */
static PFN_cuTensorMapEncodeTiled_v12000 attention_wgmma_encode = NULL;

/* The last descriptor a thread encoded for K (which 0) or V (1), and what for. */
struct attention_wgmma_map_cache {
    const void *base;
    int64_t stride_token, stride_head, total_tokens;
    int32_t num_heads, dtype;
    bool is_valid;
    CUtensorMap map;
};

/* K or V (base, strides in elements) as a (64, heads, tokens) tensor of 64 x 1 x 64 boxes in
 * the 128-byte swizzle, encoded or from this thread's cache (the same tensor again costs a
 * comparison, not an encode); false when TMA cannot read it: no driver entry point, a base
 * or stride off 16 bytes, heads that overlap or tokens that do not hold whole heads, more
 * than 2^31 tokens (the caller then copies by cp.async). */
static bool attention_wgmma_tensor_map(CUtensorMap *map, int which, const void *base,
                                       int64_t stride_token, int64_t stride_head,
                                       const ragvit_attention_args *a) {
    thread_local attention_wgmma_map_cache cache[2];
    attention_wgmma_map_cache &c = cache[which];
    if (c.is_valid && c.base == base && c.stride_token == stride_token &&
        c.stride_head == stride_head && c.total_tokens == a->total_tokens &&
        c.num_heads == a->num_heads && c.dtype == a->dtype) {
        *map = c.map;
        return true;
    }
    /* one head is never stepped over: any stride that keeps the dimensions apart */
    const int64_t head_step = a->num_heads == 1 ? 64 : stride_head;
    if (attention_wgmma_encode == NULL || ((uintptr_t)base & 15) != 0 || head_step % 8 != 0 ||
        stride_token % 8 != 0 || head_step < 64 || stride_token < head_step * a->num_heads ||
        a->total_tokens <= 0 || a->total_tokens > ((int64_t)1 << 31) ||
        stride_token >= ((int64_t)1 << 38))
        return false;
    const cuuint64_t dims[3] = {64, (cuuint64_t)a->num_heads, (cuuint64_t)a->total_tokens};
    const cuuint64_t strides[2] = {(cuuint64_t)head_step * 2, (cuuint64_t)stride_token * 2};
    const cuuint32_t box[3] = {64, 1, 64};
    const cuuint32_t elem_strides[3] = {1, 1, 1};
    CUtensorMap encoded;
    if (attention_wgmma_encode(&encoded,
                               a->dtype == RAGVIT_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                               3, const_cast<void *>(base), dims, strides, box, elem_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    c.base = base;
    c.stride_token = stride_token;
    c.stride_head = stride_head;
    c.total_tokens = a->total_tokens;
    c.num_heads = a->num_heads;
    c.dtype = a->dtype;
    c.map = encoded;
    c.is_valid = true;
    *map = encoded;
    return true;
}

/* The kernel with `keys`-key tiles (by TMA or not), for the element type is_bf16 picks. */
template <int keys, bool tma>
static ragvit_status
attention_wgmma_launch_kernel(const ragvit_attention_args *a, const ragvit_device_info *dev,
                              const attention_wgmma_maps_t<tma> &maps, bool is_bf16, dim3 grid,
                              size_t smem, int max_len, int num_stages, int thin_x,
                              cudaStream_t stream) {
    if (is_bf16)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION,
                             attention_wgmma_kernel<__nv_bfloat16, keys, tma>, grid, 128, smem,
                             stream, *a, max_len, num_stages, thin_x, maps));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_wgmma_kernel<__half, keys, tma>,
                             grid, 128, smem, stream, *a, max_len, num_stages, thin_x, maps));
    return RAGVIT_STATUS_OK;
}

/* Launches (no allocation, no host sync) with key tiles of `keys` keys (64 or 128) and
 * num_stages K and V slots each; 0 for either is the launcher's choice. A grid of one wave
 * (at most a block an SM) over sequences longer than 64 takes 128-key tiles, when two such
 * stages fit: half the loop steps (5-15% faster at batch 1-4 on an H200), and prefetches
 * every key tile (up to 5 stages). A larger grid takes 64-key tiles and 2 stages: 5 blocks
 * an SM overlap one another's steps. The grid is capped like the mma.sync plans'; a forced
 * stage count is clamped to what fits. tma: 1 takes whole 64-key tiles by TMA wherever the
 * layout allows (a head_dim-contiguous, token-major q/k/v with 16-byte aligned base and
 * strides), 0 never, < 0 the launcher's choice: TMA when max_seqlen >=
 * ATTENTION_WGMMA_TMA_MIN_LEN (257), where one thread's two box copies replacing 128
 * threads' 16 cp.async pay (4-5% faster on 32 DeiT-B images of 577 tokens on an H200, whose
 * board sits at its power cap there); below it the per-block mbarrier setup does not. */
ragvit_status attention_wgmma_launch_plan(const ragvit_attention_args *a,
                                          const ragvit_device_info *dev, int keys, int num_stages,
                                          int tma, cudaStream_t stream) {
    const int64_t max_len = attention_max_len(a);
    const int64_t rows = ATTENTION_WGMMA_ROWS;
    const int64_t sm_count = dev->sm_count > 0 ? dev->sm_count : 132;
    const int64_t seqs = a->num_seqs, heads = a->num_heads;
    int64_t grid_x = (max_len + rows - 1) / rows;
    const bool is_one_wave = grid_x * heads * seqs <= sm_count;
    if (keys <= 0) keys = is_one_wave && max_len > 64 ? 128 : 64;
    if (keys != 64 && keys != 128) keys = 64;
    if (keys == 128 && attention_wgmma_smem_bytes(128, 2) > dev->smem_per_block_optin) keys = 64;
    const int64_t key_tiles = (max_len + keys - 1) / keys;
    if (num_stages <= 0) /* s stages load key tiles 0 .. s - 2 (all, if at most s) before step 0 */
        num_stages = is_one_wave ? (int)(key_tiles + 1 < ATTENTION_WGMMA_MAX_STAGES
                                             ? key_tiles + 1
                                             : ATTENTION_WGMMA_MAX_STAGES)
                                 : 2;
    if (num_stages > ATTENTION_WGMMA_MAX_STAGES) num_stages = ATTENTION_WGMMA_MAX_STAGES;
    if (num_stages < 2) num_stages = 2;
    while (num_stages > 2 &&
           attention_wgmma_smem_bytes(keys, num_stages) > dev->smem_per_block_optin)
        --num_stages;
    const int64_t grid_z = seqs < ATTENTION_MAX_GRID_YZ ? seqs : ATTENTION_MAX_GRID_YZ;
    const int64_t query_tiles = grid_x;
    grid_x = attention_cap_grid_x(grid_x, heads, grid_z, a->total_tokens, seqs, rows, sm_count);
    /* with 64-key tiles and a block for every query tile, blocks x = query_tiles - 1 hold
     * only last tiles, of at most max_len - 64 x rows: all thin when that is <= THIN */
    const int thin_x = keys == 64 && grid_x == query_tiles &&
                               max_len - (query_tiles - 1) * rows <= ATTENTION_WGMMA_THIN
                           ? (int)(query_tiles - 1)
                           : -1;
    const dim3 grid((unsigned)grid_x, (unsigned)heads, (unsigned)grid_z);
    const size_t smem = (size_t)attention_wgmma_smem_bytes(keys, num_stages);
    const bool is_bf16 = a->dtype == RAGVIT_DTYPE_BF16;
    const attention_wgmma_no_maps no_maps;
    if (keys == 128)
        return attention_wgmma_launch_kernel<128, false>(a, dev, no_maps, is_bf16, grid, smem,
                                                         (int)max_len, num_stages, -1, stream);
    attention_wgmma_maps maps;
    if ((tma > 0 || (tma < 0 && max_len >= ATTENTION_WGMMA_TMA_MIN_LEN)) &&
        attention_wgmma_tensor_map(&maps.k, 0, a->k, a->k_stride_token, a->k_stride_head, a) &&
        attention_wgmma_tensor_map(&maps.v, 1, a->v, a->v_stride_token, a->v_stride_head, a))
        return attention_wgmma_launch_kernel<64, true>(a, dev, maps, is_bf16, grid, smem,
                                                       (int)max_len, num_stages, thin_x, stream);
    return attention_wgmma_launch_kernel<64, false>(a, dev, no_maps, is_bf16, grid, smem,
                                                    (int)max_len, num_stages, thin_x, stream);
}

/* The launcher's own plan (what the dispatcher runs). */
ragvit_status attention_wgmma_launch(const ragvit_attention_args *a, const ragvit_device_info *dev,
                                     cudaStream_t stream) {
    return attention_wgmma_launch_plan(a, dev, 0, 0, -1, stream);
}

/* Opts both element types' kernels with `keys`-key tiles in to their largest plan's shared
 * memory (or all the device allows). */
template <int keys, bool tma>
static cudaError_t attention_wgmma_opt_in(const ragvit_device_info *dev) {
    int bytes = attention_wgmma_smem_bytes(keys, ATTENTION_WGMMA_MAX_STAGES);
    if (bytes > dev->smem_per_block_optin) bytes = (int)dev->smem_per_block_optin;
    cudaError_t err = cudaFuncSetAttribute(attention_wgmma_kernel<__half, keys, tma>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(attention_wgmma_kernel<__nv_bfloat16, keys, tma>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    return err;
}

/* One-time per-device setup: opt in to the largest plans' shared memory. */
ragvit_status attention_wgmma_init(const ragvit_device_info *dev) {
    if (dev->cc_major != 9 || dev->cc_minor != 0) return RAGVIT_STATUS_OK;
    CUDA_TRY((attention_wgmma_opt_in<64, false>(dev)));
    CUDA_TRY((attention_wgmma_opt_in<64, true>(dev)));
    CUDA_TRY((attention_wgmma_opt_in<128, false>(dev)));
    if (attention_wgmma_encode == NULL) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                             cudaEnableDefault, &found) == cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            attention_wgmma_encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    return RAGVIT_STATUS_OK;
}
