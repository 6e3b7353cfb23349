/* attention_mma.cu — the mma.sync m16n8k16 path (sm_80+): fp16/bf16 q, k, v, out (T, H, D)
 * with 16-byte aligned rows, D in {32, 64, 80, 96, 128}, fp32 accumulation, optional cls_attn
 * (T,) and per-key bias (T,) fp32. grid = (query tiles, H [+ 1 with cls_attn], min(S, 65535)),
 * 1-4 warps a block, 16 query rows a warp; 64-key K/V tiles through a 2-4 stage cp.async ring
 * of D + 8-element shared rows (the padding makes ldmatrix conflict-free).
 * Decision: cls_attn is grid row y = H of the same launch (block (0, H, s) scores sequence s's
 * first query against every key): no second launch, no atomics, no zeroing pass.
 * Covered by tests/test_attention.py and dev/test_attention.cu. */
#include "attention.cuh"

#define ATTENTION_MMA_KEYS 64      /* keys per K/V tile */
#define ATTENTION_MMA_MAX_WARPS 4  /* 16 query rows per warp */
#define ATTENTION_MMA_MAX_STAGES 4 /* K/V tiles in flight */

// ---- device helpers ----

static __device__ __forceinline__ void attention_mma_ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

static __device__ __forceinline__ void attention_mma_ldmatrix_x4_trans(uint32_t r[4],
                                                                       uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* Copies `rows` rows of D elements (src row r at src + r * stride) into shared rows of
 * D + 8 elements, spread over threads `tid` of `nthreads`; rows >= valid_rows are zero-filled
 * (P = 0 must never meet garbage V). */
template <typename Elem, int D>
static __device__ __forceinline__ void attention_mma_load_rows(Elem *dst, const Elem *src,
                                                               int64_t stride, int valid_rows,
                                                               int rows, int tid, int nthreads) {
    constexpr int kChunks = D / 8; /* 16-byte chunks per row */
    constexpr int kLds = D + 8;
    for (int c = tid; c < rows * kChunks; c += nthreads) {
        const int r = c / kChunks;
        const int col = c - r * kChunks;
        const bool is_valid = r < valid_rows;
        /* row 0 exists whenever this is called; an invalid chunk reads nothing anyway */
        const Elem *g = src + (is_valid ? (int64_t)r * stride : (int64_t)0) + col * 8;
        attention_cp_async16(attention_smem_addr(dst + r * kLds + col * 8), g, is_valid);
    }
}

/* K and V rows [key0, key0 + 64) of sequence `start`, head h into one ring stage (K rows,
 * then V rows). Strides are read from the kernel parameters (no registers held). */
template <typename Elem, int D>
static __device__ __forceinline__ void attention_mma_load_kv(Elem *stage,
                                                             const ragvit_attention_args &a,
                                                             int start, int h, int key0, int len) {
    constexpr int kKeys = ATTENTION_MMA_KEYS;
    const int valid = min(kKeys, len - key0);
    const int64_t token = (int64_t)start + key0;
    attention_mma_load_rows<Elem, D>(stage,
                                     static_cast<const Elem *>(a.k) + token * a.k_stride_token +
                                         (int64_t)h * a.k_stride_head,
                                     a.k_stride_token, valid, kKeys, threadIdx.x, blockDim.x);
    attention_mma_load_rows<Elem, D>(stage + kKeys * (D + 8),
                                     static_cast<const Elem *>(a.v) + token * a.v_stride_token +
                                         (int64_t)h * a.v_stride_head,
                                     a.v_stride_token, valid, kKeys, threadIdx.x, blockDim.x);
}

/* One query tile (rows q0 .. q0 + 16 * warps - 1) of head h of the sequence whose first token
 * is `start`; rows and keys >= len are never read from global memory, rows >= len never
 * written. Key tiles stream through a ring of num_stages stages (cp.async group g = key
 * tile g, the first also holding Q): tile t + num_stages - 1 is in flight while tile t is
 * consumed, so one barrier per tile suffices. Block-uniform: all threads call it alike. */
template <typename Elem, int D, bool has_bias>
static __device__ __forceinline__ void
attention_mma_tile(Elem *s_q, Elem *s_kv, int num_stages, const ragvit_attention_args &a, int start,
                   int h, int q0, int len, float scale_log2) {
    using ops = attention_elem<Elem>;
    constexpr int kKeys = ATTENTION_MMA_KEYS;
    constexpr int kLds = D + 8;
    constexpr int kStage = 2 * kKeys * kLds; /* elements per ring stage */
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int group = lane >> 2;      /* mma groupID: rows group and group + 8 */
    const int tig = lane & 3;         /* thread in group: columns 2 * tig, 2 * tig + 1 */
    const int rows = blockDim.x >> 1; /* 16 per warp */
    const int num_tiles = (len + kKeys - 1) / kKeys;
    const int warp_row0 = q0 + warp * 16;
    const bool is_active = warp_row0 < len; /* warp-uniform */

    /* ldmatrix lane -> row/column offsets. A (Q) and V^T: matrices ordered (r0-7, c0-7),
     * (r8-15, c0-7), (r0-7, c8-15), (r8-15, c8-15). K: (n0-7, k0-7), (n0-7, k8-15),
     * (n8-15, k0-7), (n8-15, k8-15), i.e. b0b1 of two 8-key blocks. */
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int a_col = (lane >> 4) * 8;
    const int k_row = (lane & 7) + (lane >> 4) * 8;
    const int k_col = ((lane >> 3) & 1) * 8;

    __syncthreads(); /* this block's previous tile may still read shared memory */
    attention_mma_load_rows<Elem, D>(
        s_q,
        static_cast<const Elem *>(a.q) + ((int64_t)start + q0) * a.q_stride_token +
            (int64_t)h * a.q_stride_head,
        a.q_stride_token, min(rows, len - q0), rows, threadIdx.x, blockDim.x);
    for (int st = 0; st < num_stages - 1; ++st) {
        if (st < num_tiles)
            attention_mma_load_kv<Elem, D>(s_kv + st * kStage, a, start, h, st * kKeys, len);
        attention_cp_async_commit(); /* group st: key tile st (+ Q), maybe empty */
    }

    float o_acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.0f;
    /* running max (base-2 scaled) and this thread's partial row sums, rows group, group + 8 */
    float row_max0 = -INFINITY, row_max1 = -INFINITY;
    float row_sum0 = 0.0f, row_sum1 = 0.0f;

    int stage = 0; /* holds key tile t; the stage before it receives tile t + num_stages - 1 */
    for (int t = 0; t < num_tiles; ++t) {
        const int num_keys = min(kKeys, len - t * kKeys); /* >= 1 */
        attention_cp_async_wait_pending(num_stages - 2);  /* tile t landed */
        __syncthreads(); /* ... for every thread's copies; tile t - 1 fully consumed */
        if (t + num_stages - 1 < num_tiles)
            attention_mma_load_kv<Elem, D>(s_kv +
                                               (stage == 0 ? num_stages - 1 : stage - 1) * kStage,
                                           a, start, h, (t + num_stages - 1) * kKeys, len);
        attention_cp_async_commit();
        const Elem *s_k = s_kv + stage * kStage;
        const Elem *s_v = s_k + kKeys * kLds;
        stage = stage + 1 == num_stages ? 0 : stage + 1;
        if (!is_active) continue;

        /* Q fragments are re-read every tile (D / 16 ldmatrix next to the D / 2 of K and V):
         * that frees D / 4 registers during softmax and PV (D = 64 fits 128, no spills) */
        uint32_t q_frag[D / 16][4];
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            attention_mma_ldmatrix_x4(
                q_frag[kk],
                attention_smem_addr(s_q + (warp * 16 + a_row) * kLds + kk * 16 + a_col));
        float s_acc[kKeys / 8][4];
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n)
            s_acc[n][0] = s_acc[n][1] = s_acc[n][2] = s_acc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int n2 = 0; n2 < kKeys / 16; ++n2) {
                if (n2 * 16 < num_keys) { /* all-masked key pairs: skip, -inf below */
                    uint32_t b[4];
                    attention_mma_ldmatrix_x4(
                        b, attention_smem_addr(s_k + (n2 * 16 + k_row) * kLds + kk * 16 + k_col));
                    ops::mma(s_acc[2 * n2], q_frag[kk], b[0], b[1]);
                    ops::mma(s_acc[2 * n2 + 1], q_frag[kk], b[2], b[3]);
                }
            }
        }

        if (num_keys < kKeys) {
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n * 8 + 2 * tig + (e & 1) >= num_keys) s_acc[n][e] = -INFINITY;
        }
        if (has_bias) {
            /* base-2 logits now, so the max below is taken over them. Lane l loads keys l
             * and l + 32 of the tile (a key past the end reads nothing: 0, and its -inf
             * stays); this thread's keys n * 8 + 2 * tig + {0, 1} come by shuffle (the
             * whole warp is here: is_active is warp-uniform), two registers, not 16. */
            const float *bias = a.bias + ((int64_t)start + t * kKeys) * a.bias_stride;
            const float b_lo = lane < num_keys ? __ldg(bias + (int64_t)lane * a.bias_stride) : 0.0f;
            const float b_hi =
                lane + 32 < num_keys ? __ldg(bias + (int64_t)(lane + 32) * a.bias_stride) : 0.0f;
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float b =
                        __shfl_sync(0xffffffffu, n < 4 ? b_lo : b_hi, (n & 3) * 8 + 2 * tig + c) *
                        ATTENTION_LOG2E;
                    s_acc[n][c] = fmaf(s_acc[n][c], scale_log2, b);
                    s_acc[n][c + 2] = fmaf(s_acc[n][c + 2], scale_log2, b);
                }
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s_acc[n][0], s_acc[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s_acc[n][2], s_acc[n][3]));
        }
        /* the quad (lanes 4g .. 4g + 3) shares rows g and g + 8 */
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        /* key t * 64 is valid, so both maxima are finite (with a bias: a finite one);
         * without a bias, scale_log2 > 0 commutes with max and folds into the exp2's fma */
        const float m0 = fmaxf(row_max0, has_bias ? mx0 : mx0 * scale_log2);
        const float m1 = fmaxf(row_max1, has_bias ? mx1 : mx1 * scale_log2);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
            if (has_bias) {
                s_acc[n][0] = attention_exp2(s_acc[n][0] - m0);
                s_acc[n][1] = attention_exp2(s_acc[n][1] - m0);
                s_acc[n][2] = attention_exp2(s_acc[n][2] - m1);
                s_acc[n][3] = attention_exp2(s_acc[n][3] - m1);
            } else {
                s_acc[n][0] = attention_exp2(fmaf(s_acc[n][0], scale_log2, -m0));
                s_acc[n][1] = attention_exp2(fmaf(s_acc[n][1], scale_log2, -m0));
                s_acc[n][2] = attention_exp2(fmaf(s_acc[n][2], scale_log2, -m1));
                s_acc[n][3] = attention_exp2(fmaf(s_acc[n][3], scale_log2, -m1));
            }
            sum0 += s_acc[n][0] + s_acc[n][1];
            sum1 += s_acc[n][2] + s_acc[n][3];
        }
        if (t == 0) { /* single-tile sequences never rescale */
            row_sum0 = sum0;
            row_sum1 = sum1;
        } else {
            const float alpha0 = attention_exp2(row_max0 - m0);
            const float alpha1 = attention_exp2(row_max1 - m1);
            row_sum0 = fmaf(row_sum0, alpha0, sum0);
            row_sum1 = fmaf(row_sum1, alpha1, sum1);
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o_acc[i][0] *= alpha0;
                o_acc[i][1] *= alpha0;
                o_acc[i][2] *= alpha1;
                o_acc[i][3] *= alpha1;
            }
        }
        row_max0 = m0;
        row_max1 = m1;

#pragma unroll
        for (int j = 0; j < kKeys / 16; ++j) {
            if (j * 16 < num_keys) {
                /* the C fragments of key blocks 2j, 2j+1 are the A fragment of k-step j */
                uint32_t p_frag[4];
                p_frag[0] = ops::pack(s_acc[2 * j][0], s_acc[2 * j][1]);
                p_frag[1] = ops::pack(s_acc[2 * j][2], s_acc[2 * j][3]);
                p_frag[2] = ops::pack(s_acc[2 * j + 1][0], s_acc[2 * j + 1][1]);
                p_frag[3] = ops::pack(s_acc[2 * j + 1][2], s_acc[2 * j + 1][3]);
#pragma unroll
                for (int dn = 0; dn < D / 16; ++dn) {
                    uint32_t b[4];
                    attention_mma_ldmatrix_x4_trans(
                        b, attention_smem_addr(s_v + (j * 16 + a_row) * kLds + dn * 16 + a_col));
                    ops::mma(o_acc[2 * dn], p_frag, b[0], b[1]);
                    ops::mma(o_acc[2 * dn + 1], p_frag, b[2], b[3]);
                }
            }
        }
    }
    attention_cp_async_wait<0>(); /* only empty groups can be left */

    if (is_active) {
        row_sum0 += __shfl_xor_sync(0xffffffffu, row_sum0, 1);
        row_sum1 += __shfl_xor_sync(0xffffffffu, row_sum1, 1);
        row_sum0 += __shfl_xor_sync(0xffffffffu, row_sum0, 2);
        row_sum1 += __shfl_xor_sync(0xffffffffu, row_sum1, 2);
        const float inv0 = __fdividef(1.0f, row_sum0);
        const float inv1 = __fdividef(1.0f, row_sum1);
        /* Stage through this warp's own Q rows (only it reads them, and it is done) so the
         * global stores are whole 16-byte chunks. */
        Elem *s_o = s_q + warp * 16 * kLds;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const int col = i * 8 + 2 * tig;
            *reinterpret_cast<uint32_t *>(s_o + group * kLds + col) =
                ops::pack(o_acc[i][0] * inv0, o_acc[i][1] * inv0);
            *reinterpret_cast<uint32_t *>(s_o + (group + 8) * kLds + col) =
                ops::pack(o_acc[i][2] * inv1, o_acc[i][3] * inv1);
        }
        __syncwarp();
        constexpr int kChunks = D / 8;
#pragma unroll
        for (int c = lane; c < 16 * kChunks; c += 32) {
            const int r = c / kChunks;
            const int col = (c - r * kChunks) * 8;
            if (warp_row0 + r < len)
                *reinterpret_cast<uint4 *>(static_cast<Elem *>(a.out) +
                                           ((int64_t)start + warp_row0 + r) * a.out_stride_token +
                                           (int64_t)h * a.out_stride_head + col) =
                    *reinterpret_cast<const uint4 *>(s_o + r * kLds + col);
        }
    }
}

/* (m, l) <- online merge of (m, l) and (m_other, l_other); (-inf, 0) is the empty partial. */
static __device__ __forceinline__ void attention_mma_merge(float *m, float *l, float m_other,
                                                           float l_other) {
    const float m_new = fmaxf(*m, m_other);
    if (m_new != -INFINITY)
        *l = *l * attention_exp2(*m - m_new) + l_other * attention_exp2(m_other - m_new);
    *m = m_new;
}

/* Scores of the 16 keys of a shared 16-row K tile against one query, by mma with A = the K
 * rows and B = the query in column 0 (q_frag: b0, b1 per k-step, zero outside lanes 0-3).
 * Lanes with (lane & 3) == 0 receive keys lane / 4 (*x) and lane / 4 + 8 (*y). */
template <typename Elem, int D>
static __device__ __forceinline__ void attention_mma_cls_scores(const Elem *tile,
                                                                const uint32_t (&q_frag)[D / 16][2],
                                                                float *x, float *y) {
    using ops = attention_elem<Elem>;
    constexpr int kLds = D + 8;
    const int lane = threadIdx.x & 31;
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int a_col = (lane >> 4) * 8;
    float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        attention_mma_ldmatrix_x4(a, attention_smem_addr(tile + a_row * kLds + kk * 16 + a_col));
        ops::mma(c[kk & 1], a, q_frag[kk][0], q_frag[kk][1]); /* two chains: shorter latency */
    }
    *x = c[0][0] + c[1][0];
    *y = c[0][2] + c[1][2];
}

/* cls_attn of one sequence: cls[j * cls_stride] = mean over heads of softmax_j of the first
 * query's scores. Each warp streams 16-key K tiles through its own ring of shared buffers
 * (cp.async, __syncwarp only) and scores them with tensor cores (one useful column).
 * Pass 1: warp w takes heads w, w + warps, ... and keeps an online (max, sum) per lane,
 * merged by an xor butterfly into the head's stats; when H x len scores fit in shared memory
 * they are kept there. Pass 2: thread i takes keys i, i + blockDim.x, ... and adds the head
 * probabilities in head order (from the kept scores, or else warp w rescoring key tiles w,
 * w + warps, ... for every head: the same fp32 score bit for bit), then stores the mean.
 * Nothing depends on timing: the result is reproducible, with no atomics and no zeroing.
 * q, k point at the sequence's first token of head 0; bias (has_bias only) at its first
 * token's bias, added to every score (both passes alike, so the rescored bits match). */
template <typename Elem, int D, bool has_bias>
static __device__ __forceinline__ void
attention_mma_cls(unsigned char *smem, int smem_bytes, float *cls, int64_t cls_stride,
                  const Elem *q, int64_t q_head, const Elem *k, int64_t k_stride, int64_t k_head,
                  const float *bias, int64_t bias_stride, int num_heads, int len,
                  float scale_log2) {
    constexpr int kTile = 16 * (D + 8); /* elements of one 16-key tile */
    constexpr int kTileBytes = kTile * (int)sizeof(Elem);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    /* smem: [num_warps rings of num_bufs tiles] ... [scores: H x len, if kept][stats: H x 2] */
    float *s_stats = reinterpret_cast<float *>(smem + smem_bytes) - 2 * num_heads;
    const int64_t score_bytes = 4 * (int64_t)num_heads * len;
    const bool is_kept = smem_bytes - 8 * num_heads - score_bytes >=
                         (int64_t)2 * num_warps * kTileBytes; /* block-uniform */
    float *s_scores = s_stats - (is_kept ? (int64_t)num_heads * len : 0);
    const int num_bufs = min(8, (int)((smem_bytes - 8 * num_heads - (is_kept ? score_bytes : 0)) /
                                      (num_warps * kTileBytes))); /* >= 2 (plan) */
    Elem *ring = reinterpret_cast<Elem *>(smem) + warp * num_bufs * kTile;
    const int num_tiles = (len + 15) / 16;
    const bool is_key_lane = (lane & 3) == 0;
    const int key_x = lane >> 2; /* this lane's keys in a tile: key_x, key_x + 8 */
    const float inv_heads = __fdividef(1.0f, (float)num_heads);

    __syncthreads(); /* the previous user of shared memory is done */
    for (int pass = 0; pass < (is_kept ? 1 : 2); ++pass) {
        /* this warp's steps: outer index warp, warp + num_warps, ...; inner 0 .. inner - 1;
         * pass 0: (outer = head, inner = tile), pass 1: (outer = tile, inner = head) */
        const int outer_total = pass == 0 ? num_heads : num_tiles;
        const int inner = pass == 0 ? num_tiles : num_heads;
        const int outer = warp < outer_total ? (outer_total - warp + num_warps - 1) / num_warps : 0;
        const int num_steps = outer * inner;
        int load_o = warp, load_n = 0; /* next step to load */
        for (int b = 0; b < num_bufs - 1; ++b) {
            if (b < num_steps) {
                const int h = pass == 0 ? load_o : load_n, t = pass == 0 ? load_n : load_o;
                attention_mma_load_rows<Elem, D>(ring + b * kTile,
                                                 k + h * k_head + (int64_t)t * 16 * k_stride,
                                                 k_stride, min(16, len - t * 16), 16, lane, 32);
                if (++load_n == inner) {
                    load_n = 0;
                    load_o += num_warps;
                }
            }
            attention_cp_async_commit();
        }
        float m = -INFINITY, l = 0.0f, acc_x = 0.0f, acc_y = 0.0f;
        uint32_t q_frag[D / 16][2];
        int buf = 0, fill = num_bufs - 1;
        int step_o = warp, step_n = 0;
        for (int i = 0; i < num_steps; ++i) {
            const int h = pass == 0 ? step_o : step_n, t = pass == 0 ? step_n : step_o;
            if (pass == 1 || t == 0) { /* B = this head's first query in column 0 */
                const unsigned int *qw = reinterpret_cast<const unsigned int *>(q + h * q_head);
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    q_frag[kk][0] = lane < 4 ? __ldg(qw + kk * 8 + lane) : 0u;
                    q_frag[kk][1] = lane < 4 ? __ldg(qw + kk * 8 + 4 + lane) : 0u;
                }
            }
            attention_cp_async_wait_pending(num_bufs - 2); /* step i landed */
            __syncwarp(); /* ... for every lane's copies; step i - 1's buffer is free */
            if (i + num_bufs - 1 < num_steps) {
                const int lh = pass == 0 ? load_o : load_n, lt = pass == 0 ? load_n : load_o;
                attention_mma_load_rows<Elem, D>(ring + fill * kTile,
                                                 k + lh * k_head + (int64_t)lt * 16 * k_stride,
                                                 k_stride, min(16, len - lt * 16), 16, lane, 32);
                if (++load_n == inner) {
                    load_n = 0;
                    load_o += num_warps;
                }
            }
            attention_cp_async_commit();
            float x, y;
            attention_mma_cls_scores<Elem, D>(ring + buf * kTile, q_frag, &x, &y);
            if (!has_bias) {
                x *= scale_log2;
                y *= scale_log2;
            }
            const bool is_x = is_key_lane && t * 16 + key_x < len;
            const bool is_y = is_key_lane && t * 16 + key_x + 8 < len;
            if (has_bias) { /* keys past the end read no bias (and are never used) */
                const float bx =
                    is_x ? __ldg(bias + (int64_t)(t * 16 + key_x) * bias_stride) : 0.0f;
                const float by =
                    is_y ? __ldg(bias + (int64_t)(t * 16 + key_x + 8) * bias_stride) : 0.0f;
                x = fmaf(x, scale_log2, bx * ATTENTION_LOG2E);
                y = fmaf(y, scale_log2, by * ATTENTION_LOG2E);
            }
            buf = buf + 1 == num_bufs ? 0 : buf + 1;
            fill = fill + 1 == num_bufs ? 0 : fill + 1;
            if (++step_n == inner) {
                step_n = 0;
                step_o += num_warps;
            }

            if (pass == 0) {
                if (t == 0) {
                    m = -INFINITY;
                    l = 0.0f;
                }
                if (is_x) {
                    attention_mma_merge(&m, &l, x, 1.0f);
                    if (is_kept) s_scores[h * len + t * 16 + key_x] = x;
                }
                if (is_y) {
                    attention_mma_merge(&m, &l, y, 1.0f);
                    if (is_kept) s_scores[h * len + t * 16 + key_x + 8] = y;
                }
                if (t == num_tiles - 1) { /* warp-uniform; every lane ends with equal bits */
#pragma unroll
                    for (int offset = 16; offset > 0; offset >>= 1) {
                        const float m_other = __shfl_xor_sync(0xffffffffu, m, offset);
                        const float l_other = __shfl_xor_sync(0xffffffffu, l, offset);
                        attention_mma_merge(&m, &l, m_other, l_other);
                    }
                    if (lane == 0) {
                        s_stats[2 * h] = m;
                        s_stats[2 * h + 1] = __fdividef(1.0f, l);
                    }
                }
            } else {
                if (h == 0) acc_x = acc_y = 0.0f;
                const float m_h = s_stats[2 * h], inv_l_h = s_stats[2 * h + 1];
                if (is_x) acc_x = fmaf(attention_exp2(x - m_h), inv_l_h, acc_x);
                if (is_y) acc_y = fmaf(attention_exp2(y - m_h), inv_l_h, acc_y);
                if (h == num_heads - 1) {
                    if (is_x) cls[(int64_t)(t * 16 + key_x) * cls_stride] = acc_x * inv_heads;
                    if (is_y) cls[(int64_t)(t * 16 + key_x + 8) * cls_stride] = acc_y * inv_heads;
                }
            }
        }
        attention_cp_async_wait<0>(); /* only empty groups can be left */
        __syncthreads(); /* pass 1's stats (and scores) are visible; every ring is idle */
    }
    if (is_kept) {
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            float acc = 0.0f;
            for (int h = 0; h < num_heads; ++h)
                acc = fmaf(attention_exp2(s_scores[h * len + j] - s_stats[2 * h]),
                           s_stats[2 * h + 1], acc);
            cls[(int64_t)j * cls_stride] = acc * inv_heads;
        }
    }
}

// ---- kernels ----

/* Block (x, y, z): query tiles x, x + gridDim.x, ... of head y of sequences z, z + gridDim.z,
 * ...; y == num_heads (present only with cls_attn) computes cls_attn in block x == 0. Every
 * branch and loop bound is uniform across the block, so all threads reach each barrier.
 * smem: Q rows (16 per warp), then num_stages stages of 64 K rows and 64 V rows, each row
 * D + 8 elements. Min blocks per SM: 4 for D <= 64 (<= 128 registers, no spills), 3 for
 * D = 80, 96 (<= 168) and 2 for D = 128 (~185). has_bias is a template flag, so the kernels
 * without a bias are the code without the feature (the bias costs them nothing). */
template <typename Elem, int D, bool has_bias>
static __global__ void __launch_bounds__(ATTENTION_MMA_MAX_WARPS * 32,
                                         D <= 64 ? 4 : (D <= 96 ? 3 : 2))
    attention_mma_kernel(const __grid_constant__ ragvit_attention_args a, int max_len,
                         int num_stages, int smem_bytes) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    extern __shared__ __align__(16) unsigned char attention_mma_smem[];
    const int rows = blockDim.x >> 1;
    Elem *s_q = reinterpret_cast<Elem *>(attention_mma_smem);
    Elem *s_kv = s_q + rows * (D + 8);
    const int h = blockIdx.y;
    const float scale_log2 = a.scale * ATTENTION_LOG2E;
    const Elem *q_all = static_cast<const Elem *>(a.q);
    const Elem *k_all = static_cast<const Elem *>(a.k);

    for (int s = blockIdx.z; s < a.num_seqs; s += gridDim.z) {
        int start, len;
        if (!attention_seq_bounds(a, s, h, max_len, start, len)) continue;
        if (h == a.num_heads) {
            if (blockIdx.x == 0 && len > 0)
                attention_mma_cls<Elem, D, has_bias>(
                    attention_mma_smem, smem_bytes, a.cls_attn + (int64_t)start * a.cls_attn_stride,
                    a.cls_attn_stride, q_all + (int64_t)start * a.q_stride_token, a.q_stride_head,
                    k_all + (int64_t)start * a.k_stride_token, a.k_stride_token, a.k_stride_head,
                    has_bias ? a.bias + (int64_t)start * a.bias_stride : NULL, a.bias_stride,
                    a.num_heads, len, scale_log2);
            continue;
        }
        for (int q0 = blockIdx.x * rows; q0 < len; q0 += gridDim.x * rows)
            attention_mma_tile<Elem, D, has_bias>(s_q, s_kv, num_stages, a, start, h, q0, len,
                                                  scale_log2);
    }
}

// ---- launcher ----

static int64_t attention_mma_smem_bytes(int head_dim, int num_warps, int num_stages, int num_heads,
                                        bool has_cls) {
    const int64_t row_bytes = (int64_t)(head_dim + 8) * 2;
    int64_t bytes = (16 * num_warps + 2 * ATTENTION_MMA_KEYS * num_stages) * row_bytes;
    if (has_cls) { /* >= 2 tiles of 16 keys per warp, plus (max, 1/sum) per head */
        const int64_t cls_bytes = num_warps * 2 * 16 * row_bytes + 8 * (int64_t)num_heads;
        bytes = cls_bytes > bytes ? cls_bytes : bytes;
    }
    return bytes;
}

/* Most dynamic shared memory any plan asks for (attention_mma_init opts in to it). */
static int64_t attention_mma_smem_max(int head_dim) {
    const int64_t a = attention_mma_smem_bytes(head_dim, ATTENTION_MMA_MAX_WARPS,
                                               ATTENTION_MMA_MAX_STAGES, 1, false);
    const int64_t c = attention_mma_smem_bytes(head_dim, ATTENTION_MMA_MAX_WARPS, 2,
                                               ATTENTION_MMA_MAX_HEADS, true);
    return a > c ? a : c;
}

/* Chooses the launch shape; num_warps / num_stages > 0 force a value (benchmarks). */
attention_mma_plan attention_mma_make_plan(const ragvit_attention_args *a,
                                           const ragvit_device_info *dev, int num_warps,
                                           int num_stages) {
    const int64_t max_len = attention_max_len(a);
    const int64_t sm_count = dev != NULL && dev->sm_count > 0 ? dev->sm_count : 132;
    int64_t smem_limit =
        dev != NULL && dev->smem_per_block_optin > 0 ? dev->smem_per_block_optin : 48 * 1024;
    if (smem_limit > attention_mma_smem_max(a->head_dim))
        smem_limit = attention_mma_smem_max(a->head_dim); /* what init opted in to */
    const int64_t heads = a->num_heads;
    const int64_t seqs = a->num_seqs;
    const bool has_cls = a->cls_attn != NULL;
    const int64_t key_tiles = (max_len + ATTENTION_MMA_KEYS - 1) / ATTENTION_MMA_KEYS;

    /* Four warps (64 query rows) unless the sequences are shorter: measured on an H200,
     * smaller blocks lost even at batch 1 (more copies of K/V, less load parallelism). */
    if (num_warps <= 0) num_warps = (int)((max_len + 15) / 16);
    if (num_warps > ATTENTION_MMA_MAX_WARPS) num_warps = ATTENTION_MMA_MAX_WARPS;
    /* At most one wave of blocks: nothing else hides memory latency, so put up to 4 key
     * tiles in flight. More blocks: 2 stages (double buffering) keep 4 blocks per SM. */
    if (num_stages <= 0) {
        const int64_t blocks = ((max_len + 16 * num_warps - 1) / (16 * num_warps)) * heads * seqs;
        num_stages = 2;
        if (blocks <= sm_count)
            num_stages =
                (int)(key_tiles < ATTENTION_MMA_MAX_STAGES ? (key_tiles > 2 ? key_tiles : 2)
                                                           : ATTENTION_MMA_MAX_STAGES);
    }
    if (num_stages < 2) num_stages = 2;
    if (num_stages > ATTENTION_MMA_MAX_STAGES) num_stages = ATTENTION_MMA_MAX_STAGES;
    while (num_stages > 2 && attention_mma_smem_bytes(a->head_dim, num_warps, num_stages,
                                                      a->num_heads, has_cls) > smem_limit)
        --num_stages;
    while (num_warps > 1 && attention_mma_smem_bytes(a->head_dim, num_warps, num_stages,
                                                     a->num_heads, has_cls) > smem_limit)
        --num_warps;

    const int64_t grid_y = heads + (has_cls ? 1 : 0);
    const int64_t grid_z = seqs < ATTENTION_MAX_GRID_YZ ? seqs : ATTENTION_MAX_GRID_YZ;
    int64_t grid_x = (max_len + 16 * num_warps - 1) / (16 * num_warps);
    grid_x = attention_cap_grid_x(grid_x, grid_y, grid_z, a->total_tokens, seqs, 16 * num_warps,
                                  sm_count);

    attention_mma_plan plan;
    plan.num_warps = num_warps;
    plan.num_stages = num_stages;
    plan.max_len = (int)max_len;
    plan.smem_bytes =
        (int)attention_mma_smem_bytes(a->head_dim, num_warps, num_stages, a->num_heads, has_cls);
    plan.grid = dim3((unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z);
    return plan;
}

/* Whether this path can run these arguments (when false the dispatcher takes the FMA
 * path). Needs fp16/bf16, a listed head_dim, 16-byte aligned rows (every base
 * pointer % 16 == 0 and every token/head stride a multiple of 8 elements), at most
 * ATTENTION_MMA_MAX_HEADS heads, and (when dev is given) compute capability >= 8.0
 * and room for the smallest plan in the opt-in shared memory (D = 96, 128 need > 48 KB). */
bool attention_mma_supports(const ragvit_attention_args *a, const ragvit_device_info *dev) {
    if (a->dtype != RAGVIT_DTYPE_F16 && a->dtype != RAGVIT_DTYPE_BF16) return false;
    if (a->head_dim != 32 && a->head_dim != 64 && a->head_dim != 80 && a->head_dim != 96 &&
        a->head_dim != 128)
        return false;
    if (a->num_heads < 1 || a->num_heads > ATTENTION_MMA_MAX_HEADS) return false;
    if (dev != NULL) {
        const int64_t limit = dev->smem_per_block_optin > 0 ? dev->smem_per_block_optin : 48 * 1024;
        if (dev->cc_major < 8 ||
            attention_mma_smem_bytes(a->head_dim, 1, 2, a->num_heads, a->cls_attn != NULL) > limit)
            return false;
    }
    const uintptr_t ptr_bits =
        (uintptr_t)a->q | (uintptr_t)a->k | (uintptr_t)a->v | (uintptr_t)a->out;
    const int64_t stride_bits = a->q_stride_token | a->q_stride_head | a->k_stride_token |
                                a->k_stride_head | a->v_stride_token | a->v_stride_head |
                                a->out_stride_token | a->out_stride_head;
    return (ptr_bits & 15u) == 0 && (stride_bits & 7) == 0;
}

template <typename Elem, int D>
static ragvit_status attention_mma_launch_hdim(const ragvit_attention_args *a,
                                               const attention_mma_plan *plan,
                                               const ragvit_device_info *dev, cudaStream_t stream) {
    if (a->bias != NULL)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_mma_kernel<Elem, D, true>,
                             plan->grid, 32 * plan->num_warps, (size_t)plan->smem_bytes, stream, *a,
                             plan->max_len, plan->num_stages, plan->smem_bytes));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_mma_kernel<Elem, D, false>,
                             plan->grid, 32 * plan->num_warps, (size_t)plan->smem_bytes, stream, *a,
                             plan->max_len, plan->num_stages, plan->smem_bytes));
    return RAGVIT_STATUS_OK;
}

/* Launches with an explicit plan (from attention_mma_make_plan; dev/test_attention.cu
 * forces plans through it). */
ragvit_status attention_mma_launch_plan(const ragvit_attention_args *a,
                                        const attention_mma_plan *plan,
                                        const ragvit_device_info *dev, cudaStream_t stream) {
    const bool is_bf16 = a->dtype == RAGVIT_DTYPE_BF16;
    switch (a->head_dim) {
    case 32:
        return is_bf16 ? attention_mma_launch_hdim<__nv_bfloat16, 32>(a, plan, dev, stream)
                       : attention_mma_launch_hdim<__half, 32>(a, plan, dev, stream);
    case 64:
        return is_bf16 ? attention_mma_launch_hdim<__nv_bfloat16, 64>(a, plan, dev, stream)
                       : attention_mma_launch_hdim<__half, 64>(a, plan, dev, stream);
    case 80:
        return is_bf16 ? attention_mma_launch_hdim<__nv_bfloat16, 80>(a, plan, dev, stream)
                       : attention_mma_launch_hdim<__half, 80>(a, plan, dev, stream);
    case 96:
        return is_bf16 ? attention_mma_launch_hdim<__nv_bfloat16, 96>(a, plan, dev, stream)
                       : attention_mma_launch_hdim<__half, 96>(a, plan, dev, stream);
    case 128:
        return is_bf16 ? attention_mma_launch_hdim<__nv_bfloat16, 128>(a, plan, dev, stream)
                       : attention_mma_launch_hdim<__half, 128>(a, plan, dev, stream);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "attention: head_dim must be one of 32, 64, 80, 96, 128, got %d",
                           (int)a->head_dim);
    }
}

/* Launches the plan attention_mma_make_plan chooses (the caller checked
 * attention_mma_supports, set the device, ran attention_init once, and guarantees
 * num_seqs > 0); no allocation, no host sync. */
ragvit_status attention_mma_launch(const ragvit_attention_args *a, const ragvit_device_info *dev,
                                   cudaStream_t stream) {
    const attention_mma_plan plan = attention_mma_make_plan(a, dev, 0, 0);
    return attention_mma_launch_plan(a, &plan, dev, stream);
}

template <typename Elem, int D>
static ragvit_status attention_mma_init_hdim(const ragvit_device_info *dev) {
    int64_t bytes = attention_mma_smem_max(D);
    if (bytes <= 48 * 1024) return RAGVIT_STATUS_OK;
    if (bytes > dev->smem_per_block_optin) /* the plans then stay under the device's limit */
        bytes = dev->smem_per_block_optin;
    CUDA_TRY(cudaFuncSetAttribute(attention_mma_kernel<Elem, D, false>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    CUDA_TRY(cudaFuncSetAttribute(attention_mma_kernel<Elem, D, true>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return RAGVIT_STATUS_OK;
}

/* One-time per-device setup (the device is current): opt in to the dynamic shared memory
 * the largest plan needs. Devices below sm_80 have no image and are skipped
 * (attention_mma_supports refuses them). */
ragvit_status attention_mma_init(const ragvit_device_info *dev) {
    if (dev->cc_major < 8) return RAGVIT_STATUS_OK;
    ragvit_status status = RAGVIT_STATUS_OK;
#define ATTENTION_MMA_INIT(D)                                                                      \
    if ((status = attention_mma_init_hdim<__half, D>(dev)) != RAGVIT_STATUS_OK) return status;     \
    if ((status = attention_mma_init_hdim<__nv_bfloat16, D>(dev)) != RAGVIT_STATUS_OK)             \
        return status;
    ATTENTION_MMA_INIT(32)
    ATTENTION_MMA_INIT(64)
    ATTENTION_MMA_INIT(80)
    ATTENTION_MMA_INIT(96)
    ATTENTION_MMA_INIT(128)
#undef ATTENTION_MMA_INIT
    return RAGVIT_STATUS_OK;
}
