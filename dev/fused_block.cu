/* fused_block.cu — one persistent kernel per ViT transformer block (pre-norm, as timm's Block):
 *   x1 = x + proj(attention(qkv(LN1(x))));  out = x1 + fc2(GELU(fc1(LN2(x1))))
 * on packed ragged rows x: (T, C) fp16/bf16, cu_seqlens: (S+1,) int32, head_dim 64, C = 64 H.
 * One cooperative launch runs five stages (LN1+qkv, attention, proj+residual, LN2+fc1+GELU,
 * fc2+residual) with a grid-wide barrier between them, because at batch 1 the ~9 kernels of
 * a block cost more in launch gaps than in work. grid = SMs x CTAs an SM (occupancy API), 128
 * threads a CTA; GEMM stages deal 32x64 output tiles (x K splits) round-robin over the CTAs,
 * attention deals one warp per (sequence, head, 16 query rows). Checked against a float64 CPU
 * reference (and --cpu-selftest checks that reference without a GPU); docs/kernels/fused_block.md
 * has the design, dev/README.md the options. Build, check (then time, with --bench) and
 * sanitize on cc 9.0 GPUs (for sm_80 GPUs: -gencode=arch=compute_80,code=sm_80):
 *   nvcc -std=c++17 -O3 -Icsrc/include -Icsrc/kernels -gencode=arch=compute_90a,code=sm_90a \
 *     -Xptxas -v dev/fused_block.cu -o dev/fused_block.bin && dev/fused_block.bin --bench
 *   nvcc -std=c++17 -O3 -lineinfo -Icsrc/include -Icsrc/kernels \
 *     -gencode=arch=compute_90a,code=sm_90a dev/fused_block.cu -o dev/fused_block_debug.bin
 *   compute-sanitizer --tool memcheck dev/fused_block_debug.bin --quick
 *   compute-sanitizer --tool racecheck dev/fused_block_debug.bin --quick
 *   dev/fused_block.bin --cpu-selftest      (the reference and the checker; no GPU needed)
 * With -DFUSED_BLOCK_LIBRARY -Xcompiler -fPIC -shared it builds as a library of four C entry
 * points instead (no main), which dev/fused_block_check.py loads to set the kernel beside
 * ragvit's present path on a timm block. */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "attention.cuh" /* attention_elem (pack, unpack, mma.sync) and the cp.async helpers */
#include "workbench.h"

// ---- shapes and parameters ----

enum { kThreads = 128, kWarps = kThreads / 32 };
enum { kTileM = 32, kTileN = 64, kTileK = 64 }; /* GEMM tiles */
enum { kMaxSlots = 8 };    /* W ring slots at most (a wait_group count of 0..6) */
enum { kMaxPanelK = 768 }; /* K columns of A one GEMM item holds (C of DeiT-B) */
enum { kHeadDim = 64, kKeyTile = 64, kQueryRows = 16 };
enum { kRowPad = 8 }; /* shared rows padded by 16 bytes: ldmatrix is conflict-free */
enum { kNumStamps = 6 };

/* Dynamic shared memory: the larger of a GEMM item (A panel + a W ring of as many slots as
 * fit: enough for every W tile of a K = 384 item at once, 3 at K = 768) and the attention
 * stage (per warp: a Q tile, a K tile and a V tile). */
static constexpr int kWSlotElems = kTileN * (kTileK + kRowPad);
static constexpr int kGemmSmem384 = (kTileM * (384 + kRowPad) + 6 * kWSlotElems) * 2;
static constexpr int kGemmSmem768 = (kTileM * (kMaxPanelK + kRowPad) + 3 * kWSlotElems) * 2;
static constexpr int kGemmSmem = kGemmSmem384 > kGemmSmem768 ? kGemmSmem384 : kGemmSmem768;
static constexpr int kAttnSmem = kWarps * (2 * kKeyTile + kQueryRows) * (kHeadDim + kRowPad) * 2;
static constexpr int kSmemBytes = kGemmSmem > kAttnSmem ? kGemmSmem : kAttnSmem;

/* Every tensor is row-major in the block's dtype; weights as torch.nn.Linear keeps them. */
struct fused_block_params {
    void *out;                   /* (T, C) */
    const void *x;               /* (T, C) */
    const void *ln1_w, *ln1_b;   /* (C,) */
    const void *w_qkv, *b_qkv;   /* (3C, C), (3C,) */
    const void *w_proj, *b_proj; /* (C, C), (C,) */
    const void *ln2_w, *ln2_b;   /* (C,) */
    const void *w_fc1, *b_fc1;   /* (4C, C), (4C,) */
    const void *w_fc2, *b_fc2;   /* (C, 4C), (C,) */
    void *qkv;                   /* scratch (T, 3, H, D) */
    void *attn;                  /* scratch (T, H, D) */
    void *x1;                    /* scratch (T, C) */
    void *hidden;                /* scratch (T, 4C) */
    float *partials;             /* scratch (max splits, T, C) fp32 split-K partial sums */
    unsigned *tile_counters;     /* (ceil(T/32) * C/64,) zero at launch, zero again at exit */
    unsigned *barrier;           /* (4,) zero at allocation; see grid_barrier */
    unsigned long long *stamps;  /* nullptr, or (kNumStamps,) %globaltimer at each barrier */
    const int *cu_seqlens;       /* (S+1,) */
    int num_seqs, total_tokens, channels, num_heads, max_seqlen;
    int proj_splits, fc2_splits;  /* K splits of the two GEMMs with a residual epilogue */
    float scale_log2;             /* softmax scale * log2(e) */
    int is_barriers_only;         /* 1: the launch's barriers (and stamps) without the stages */
    int barrier_kind;             /* kGenerationBarrier or kFlipBarrier (grid_barrier) */
    unsigned long long *arrivals; /* nullptr, or (grid, kNumStamps) with stamps: %globaltimer as
                                   * each CTA arrives at each barrier (all its warps done) */
};

enum { kGenerationBarrier = 0, kFlipBarrier = 1 };

// ---- device helpers ----

/* 16 bytes global -> shared, through L2 only (.cg): data written earlier in this launch by
 * other SMs is never served from a stale L1 line. */
static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    attention_cp_async16(attention_smem_addr(smem), gmem, true);
}

static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}

static __device__ __forceinline__ unsigned atomic_add_acq_rel(unsigned *p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "l"(p), "r"(v)
                 : "memory");
    return old;
}

static __device__ __forceinline__ unsigned load_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ unsigned atomic_add_release(unsigned *p, unsigned v) {
    unsigned old;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "l"(p), "r"(v)
                 : "memory");
    return old;
}

static __device__ __forceinline__ void store_release(unsigned *p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ unsigned long long global_timer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

/* Grid-wide barrier of a cooperative launch (every CTA resident), in one of two kinds:
 * - kGenerationBarrier, sense-reversing on barrier[0] (arrivals) and barrier[1] (generation):
 *   a CTA reads the generation before it arrives (it cannot move until every CTA has
 *   arrived); the last to arrive zeroes the count and publishes generation + 1 with a
 *   release, so a CTA that sees the new generation also sees the zero count and every write
 *   made before the barrier. Full fences on both sides of the arrival.
 * - kFlipBarrier, one atomic a CTA on barrier[2]: CTA 0 adds 2^31 - (CTAs - 1) and every other
 *   CTA 1, with release semantics, so the word gains exactly 2^31 per barrier and its top bit
 *   flips on the last arrival, not before (its low 31 bits are zero between barriers); a CTA
 *   waits, with acquire loads, until the top bit differs from the one its own add returned.
 *   The release of every arrival and the acquire of the load that sees the flip order each
 *   CTA's writes (made before the __syncthreads) before every other CTA's reads after it.
 * Both leave their words ready for the next barrier and the next launch. */
static __device__ __forceinline__ void grid_barrier(unsigned *barrier, int kind,
                                                    unsigned long long *arrival) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (arrival != nullptr) *arrival = global_timer();
        if (kind == kFlipBarrier) {
            const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
            const unsigned old = atomic_add_release(barrier + 2, add);
            while (((old ^ load_acquire(barrier + 2)) & 0x80000000u) == 0u) {
            }
        } else {
            const unsigned gen = load_acquire(barrier + 1);
            __threadfence();
            const unsigned arrived = atomic_add_acq_rel(barrier, 1u);
            if (arrived == gridDim.x - 1) {
                barrier[0] = 0u;
                store_release(barrier + 1, gen + 1u);
            } else {
                while (load_acquire(barrier + 1) == gen) __nanosleep(32);
            }
            __threadfence();
        }
    }
    __syncthreads();
}

static __device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

/* One GEMM stage: out = epilogue(A W^T + bias) for A (T, K), W (N, K); N % 64 == 0,
 * K % (64 * splits) == 0, K / splits <= kMaxPanelK. */
template <typename T> struct gemm_stage {
    const T *a; /* (T, K), row stride lda */
    int lda;
    const T *w, *bias;    /* (N, K), (N,) */
    const T *ln_w, *ln_b; /* non-null: A rows are LayerNorm'ed first (splits == 1) */
    const T *resid;       /* non-null: (T, N) added after the bias */
    T *out;               /* (T, N) */
    int n, k, splits;
    bool is_gelu;
};

/* LayerNorm (eps 1e-6, fp32 statistics, two passes) of the A panel's rows in place. */
template <typename T>
static __device__ void layer_norm_panel(T *sa, int stride, int k, const T *ln_w, const T *ln_b) {
    using ops = attention_elem<T>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = warp; r < kTileM; r += kWarps) {
        uint32_t *row = reinterpret_cast<uint32_t *>(sa + r * stride);
        float sum = 0.0f;
        for (int c = lane; c < k / 2; c += 32) {
            const float2 v = ops::unpack(row[c]);
            sum += v.x + v.y;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float mean = sum / (float)k;
        float var = 0.0f;
        for (int c = lane; c < k / 2; c += 32) {
            const float2 v = ops::unpack(row[c]);
            var += (v.x - mean) * (v.x - mean) + (v.y - mean) * (v.y - mean);
        }
        for (int o = 16; o > 0; o >>= 1) var += __shfl_xor_sync(0xffffffffu, var, o);
        const float rstd = rsqrtf(var / (float)k + 1e-6f);
        const uint32_t *gw = reinterpret_cast<const uint32_t *>(ln_w);
        const uint32_t *gb = reinterpret_cast<const uint32_t *>(ln_b);
        for (int c = lane; c < k / 2; c += 32) {
            const float2 v = ops::unpack(row[c]);
            const float2 g = ops::unpack(__ldg(gw + c)), b = ops::unpack(__ldg(gb + c));
            row[c] = ops::pack((v.x - mean) * rstd * g.x + b.x, (v.y - mean) * rstd * g.y + b.y);
        }
    }
}

/* Items are (split, row tile, column tile), split fastest, dealt round-robin over the CTAs;
 * each CTA computes a 32x64 tile with 4 warps of 16x32. The A panel (32 rows x K / splits)
 * is loaded whole; the W tiles stream through a ring of as many slots as the shared memory
 * left by the panel holds (up to one per W tile), one cp.async group a tile. With
 * splits > 1 every item writes its fp32 partial tile; the last of a tile's items to finish
 * (an acq_rel counter) sums the partials in split order, so the result does not depend on
 * which CTA finished last. */
template <typename T>
static __device__ void gemm_run(const gemm_stage<T> &g, int num_rows, char *smem,
                                unsigned *counters, float *partials) {
    using ops = attention_elem<T>;
    __shared__ int s_is_last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int kc = g.k / g.splits;
    const int a_stride = kc + kRowPad;
    const int w_stride = kTileK + kRowPad;
    T *sa = reinterpret_cast<T *>(smem);
    T *sw = sa + kTileM * a_stride;
    const int row_tiles = (num_rows + kTileM - 1) / kTileM, col_tiles = g.n / kTileN;
    const int items = row_tiles * col_tiles * g.splits;
    const int k_tiles = kc / kTileK;
    const int free_slots = (kSmemBytes / 2 - kTileM * a_stride) / kWSlotElems;
    const int slots = max(2, min(k_tiles, min(free_slots, (int)kMaxSlots)));
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int split = item % g.splits, tile = item / g.splits;
        const int m0 = (tile % row_tiles) * kTileM, n0 = (tile / row_tiles) * kTileN;
        const int k0 = split * kc;
        const int chunks = kc / 8; /* 16-byte chunks an A row */
        for (int c = tid; c < kTileM * chunks; c += kThreads) {
            const int r = c / chunks, cc = c % chunks;
            T *dst = sa + r * a_stride + cc * 8;
            if (m0 + r < num_rows)
                cp_async16(dst, g.a + (size_t)(m0 + r) * g.lda + k0 + cc * 8);
            else
                *reinterpret_cast<uint4 *>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
        attention_cp_async_commit();
        auto load_w = [&](int kt) {
            if (kt < k_tiles) {
                T *dst = sw + (kt % slots) * kWSlotElems;
                const T *src = g.w + (size_t)n0 * g.k + k0 + kt * kTileK;
                for (int c = tid; c < kTileN * 8; c += kThreads)
                    cp_async16(dst + (c >> 3) * w_stride + (c & 7) * 8,
                               src + (size_t)(c >> 3) * g.k + (c & 7) * 8);
            }
            attention_cp_async_commit(); /* empty groups keep the group count = tile index */
        };
        for (int s = 0; s < slots - 1; ++s) load_w(s);
        float acc[4][4];
        for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
        for (int kt = 0; kt < k_tiles; ++kt) {
            attention_cp_async_wait_pending(slots - 2); /* the A panel and W tile kt have landed */
            __syncthreads();
            if (kt == 0 && g.ln_w != nullptr) {
                layer_norm_panel<T>(sa, a_stride, kc, g.ln_w, g.ln_b);
                __syncthreads();
            }
            load_w(kt + slots - 1); /* into the slot tile kt - 1 used */
            const T *swt = sw + (kt % slots) * kWSlotElems;
            for (int kk = 0; kk < kTileK / 16; ++kk) {
                uint32_t a[4];
                ldsm_x4(a, sa + (wm * 16 + (lane & 15)) * a_stride + kt * kTileK + kk * 16 +
                               (lane >> 4) * 8);
                for (int np = 0; np < 2; ++np) {
                    uint32_t b[4];
                    ldsm_x4(b,
                            swt + (wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * w_stride +
                                kk * 16 + ((lane >> 3) & 1) * 8);
                    ops::mma(acc[2 * np], a, b[0], b[1]);
                    ops::mma(acc[2 * np + 1], a, b[2], b[3]);
                }
            }
        }
        const int g8 = lane >> 2, t4 = lane & 3;
        if (g.splits == 1) {
            for (int j = 0; j < 4; ++j)
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + wm * 16 + g8 + h * 8;
                    const int col = n0 + wn * 32 + j * 8 + 2 * t4;
                    if (row >= num_rows) continue;
                    const float2 b =
                        ops::unpack(__ldg(reinterpret_cast<const uint32_t *>(g.bias + col)));
                    float v0 = acc[j][2 * h] + b.x, v1 = acc[j][2 * h + 1] + b.y;
                    if (g.is_gelu) {
                        v0 = gelu_erf(v0);
                        v1 = gelu_erf(v1);
                    }
                    const size_t e = (size_t)row * g.n + col;
                    if (g.resid != nullptr) {
                        const float2 r =
                            ops::unpack(__ldcg(reinterpret_cast<const unsigned *>(g.resid + e)));
                        v0 += r.x;
                        v1 += r.y;
                    }
                    *reinterpret_cast<uint32_t *>(g.out + e) = ops::pack(v0, v1);
                }
        } else {
            for (int j = 0; j < 4; ++j)
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + wm * 16 + g8 + h * 8;
                    const int col = n0 + wn * 32 + j * 8 + 2 * t4;
                    if (row >= num_rows) continue;
                    float2 *dst = reinterpret_cast<float2 *>(
                        partials + ((size_t)split * num_rows + row) * g.n + col);
                    __stcg(dst, make_float2(acc[j][2 * h], acc[j][2 * h + 1]));
                }
            __threadfence();
            __syncthreads();
            if (tid == 0)
                s_is_last = atomic_add_acq_rel(counters + tile, 1u) == (unsigned)(g.splits - 1);
            __syncthreads();
            if (s_is_last) {
                __threadfence();
                for (int c = tid; c < kTileM * kTileN / 4; c += kThreads) {
                    const int row = m0 + c / (kTileN / 4), col = n0 + (c % (kTileN / 4)) * 4;
                    if (row >= num_rows) continue;
                    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    for (int s = 0; s < g.splits; ++s) {
                        const float4 v = __ldcg(reinterpret_cast<const float4 *>(
                            partials + ((size_t)s * num_rows + row) * g.n + col));
                        sum.x += v.x;
                        sum.y += v.y;
                        sum.z += v.z;
                        sum.w += v.w;
                    }
                    const uint2 braw = __ldg(reinterpret_cast<const uint2 *>(g.bias + col));
                    const size_t e = (size_t)row * g.n + col;
                    const uint2 rraw = __ldcg(reinterpret_cast<const uint2 *>(g.resid + e));
                    const float2 b0 = ops::unpack(braw.x), b1 = ops::unpack(braw.y);
                    const float2 r0 = ops::unpack(rraw.x), r1 = ops::unpack(rraw.y);
                    uint2 o;
                    o.x = ops::pack(sum.x + b0.x + r0.x, sum.y + b0.y + r0.y);
                    o.y = ops::pack(sum.z + b1.x + r1.x, sum.w + b1.y + r1.y);
                    *reinterpret_cast<uint2 *>(g.out + e) = o;
                }
                if (tid == 0) counters[tile] = 0u; /* ready for the next stage and launch */
            }
        }
        __syncthreads(); /* the next item's loads overwrite the panel and the ring */
    }
    attention_cp_async_wait<0>();
}

/* Attention: each warp takes (sequence, head, 16 query rows) items with its own Q, K and V
 * tiles in shared memory: 64-key tiles of K and V come by cp.async (rows past the sequence
 * are zeros; Q comes with the first tile, and each V tile in a group of its own, so that
 * S = Q K^T starts before V lands), S = Q K^T and O += P V run on mma.sync with the online
 * softmax in fp32 (P rounded to the dtype for the second product). A sequence longer than
 * max_seqlen, or outside [0, T], is skipped. */
template <typename T>
static __device__ void attention_run(const fused_block_params &p, char *smem) {
    using ops = attention_elem<T>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int C = p.channels, H = p.num_heads;
    const int stride = kHeadDim + kRowPad;
    T *sk = reinterpret_cast<T *>(smem) + warp * (2 * kKeyTile + kQueryRows) * stride;
    T *sv = sk + kKeyTile * stride;
    T *sq = sv + kKeyTile * stride;
    const T *qkv = static_cast<const T *>(p.qkv);
    T *out = static_cast<T *>(p.attn);
    const int q_tiles = (p.max_seqlen + kQueryRows - 1) / kQueryRows;
    const int items = p.num_seqs * H * q_tiles;
    for (int item = blockIdx.x * kWarps + warp; item < items; item += gridDim.x * kWarps) {
        const int qt = item % q_tiles, h = (item / q_tiles) % H, s = item / (q_tiles * H);
        const int start = __ldg(p.cu_seqlens + s), end = __ldg(p.cu_seqlens + s + 1);
        if (start < 0 || end < start || end > p.total_tokens || end - start > p.max_seqlen)
            continue;
        const int len = end - start, q0 = qt * kQueryRows;
        if (q0 >= len) continue;
        const T *base = qkv + (size_t)start * 3 * C + h * kHeadDim;
        for (int c = lane; c < kQueryRows * 8; c += 32) {
            const int r = c >> 3, cc = c & 7;
            T *dst = sq + r * stride + cc * 8;
            if (q0 + r < len)
                cp_async16(dst, base + (size_t)(q0 + r) * 3 * C + cc * 8);
            else
                *reinterpret_cast<uint4 *>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
        uint32_t qf[4][4];
        float o[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
        for (int kb = 0; kb < len; kb += kKeyTile) {
            for (int c = lane; c < kKeyTile * 8; c += 32) {
                const int r = c >> 3, cc = c & 7;
                T *dk = sk + r * stride + cc * 8;
                if (kb + r < len)
                    cp_async16(dk, base + (size_t)(kb + r) * 3 * C + C + cc * 8);
                else
                    *reinterpret_cast<uint4 *>(dk) = make_uint4(0u, 0u, 0u, 0u);
            }
            attention_cp_async_commit(); /* K (and Q, on the first tile) */
            for (int c = lane; c < kKeyTile * 8; c += 32) {
                const int r = c >> 3, cc = c & 7;
                T *dv = sv + r * stride + cc * 8;
                if (kb + r < len)
                    cp_async16(dv, base + (size_t)(kb + r) * 3 * C + 2 * C + cc * 8);
                else
                    *reinterpret_cast<uint4 *>(dv) = make_uint4(0u, 0u, 0u, 0u);
            }
            attention_cp_async_commit(); /* V */
            attention_cp_async_wait<1>();
            __syncwarp();
            if (kb == 0)
                for (int kk = 0; kk < 4; ++kk)
                    ldsm_x4(qf[kk], sq + (lane & 15) * stride + kk * 16 + (lane >> 4) * 8);
            float sc[8][4];
            for (int j = 0; j < 8; ++j)
                for (int e = 0; e < 4; ++e) sc[j][e] = 0.0f;
            for (int kk = 0; kk < 4; ++kk)
                for (int jp = 0; jp < 4; ++jp) {
                    uint32_t b[4];
                    ldsm_x4(b, sk + (jp * 16 + (lane & 7) + ((lane >> 4) << 3)) * stride + kk * 16 +
                                   ((lane >> 3) & 1) * 8);
                    ops::mma(sc[2 * jp], qf[kk], b[0], b[1]);
                    ops::mma(sc[2 * jp + 1], qf[kk], b[2], b[3]);
                }
            float mx[2] = {-INFINITY, -INFINITY};
            for (int j = 0; j < 8; ++j)
                for (int e = 0; e < 4; ++e) {
                    const int key = kb + j * 8 + 2 * t4 + (e & 1);
                    sc[j][e] = key < len ? sc[j][e] * p.scale_log2 : -INFINITY;
                    mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]);
                }
            float alpha[2], sum[2] = {0.0f, 0.0f};
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]); /* finite: key kb is in the sequence */
                alpha[r] = exp2f(m[r] - m_new);
                m[r] = m_new;
            }
            for (int j = 0; j < 8; ++j)
                for (int e = 0; e < 4; ++e) {
                    sc[j][e] = exp2f(sc[j][e] - m[e >> 1]);
                    sum[e >> 1] += sc[j][e];
                    o[j][e] *= alpha[e >> 1];
                }
            l[0] = l[0] * alpha[0] + sum[0];
            l[1] = l[1] * alpha[1] + sum[1];
            attention_cp_async_wait<0>();
            __syncwarp();
            for (int kk = 0; kk < 4; ++kk) {
                uint32_t a[4];
                a[0] = ops::pack(sc[2 * kk][0], sc[2 * kk][1]);
                a[1] = ops::pack(sc[2 * kk][2], sc[2 * kk][3]);
                a[2] = ops::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                a[3] = ops::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
                for (int dp = 0; dp < 4; ++dp) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, sv + (kk * 16 + (lane & 15)) * stride + dp * 16 +
                                         (lane >> 4) * 8);
                    ops::mma(o[2 * dp], a, b[0], b[1]);
                    ops::mma(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
            __syncwarp(); /* the next key tile overwrites sk and sv */
        }
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
            l[r] = 1.0f / l[r];
        }
        for (int h2 = 0; h2 < 2; ++h2) {
            const int row = q0 + g8 + h2 * 8;
            if (row >= len) continue;
            T *dst = out + (size_t)(start + row) * C + h * kHeadDim + 2 * t4;
            for (int j = 0; j < 8; ++j)
                *reinterpret_cast<uint32_t *>(dst + j * 8) =
                    ops::pack(o[j][2 * h2] * l[h2], o[j][2 * h2 + 1] * l[h2]);
        }
    }
}

// ---- kernels ----

/* Where this CTA stamps its arrival at barrier b (1..kNumStamps - 1), or nullptr. */
static __device__ __forceinline__ unsigned long long *arrival_slot(const fused_block_params &p,
                                                                   int b) {
    return p.arrivals == nullptr ? nullptr : p.arrivals + (size_t)blockIdx.x * kNumStamps + b;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) fused_block_kernel(const fused_block_params p) {
    extern __shared__ uint4 smem_u4[];
    char *smem = reinterpret_cast<char *>(smem_u4);
    const bool is_stamped = p.stamps != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
    const int C = p.channels, M = p.total_tokens;
    if (is_stamped) p.stamps[0] = global_timer();
    if (p.is_barriers_only) { /* the floor of a stage: its barrier, as the stages reach it */
        for (int b = 1; b < kNumStamps; ++b) {
            if (b + 1 == kNumStamps && p.stamps == nullptr) break;
            grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, b));
            if (is_stamped) p.stamps[b] = global_timer();
        }
        return;
    }

    gemm_stage<T> g;
    g.a = static_cast<const T *>(p.x);
    g.lda = C;
    g.w = static_cast<const T *>(p.w_qkv);
    g.bias = static_cast<const T *>(p.b_qkv);
    g.ln_w = static_cast<const T *>(p.ln1_w);
    g.ln_b = static_cast<const T *>(p.ln1_b);
    g.resid = nullptr;
    g.out = static_cast<T *>(p.qkv);
    g.n = 3 * C;
    g.k = C;
    g.splits = 1;
    g.is_gelu = false;
    gemm_run<T>(g, M, smem, p.tile_counters, p.partials);
    grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, 1));
    if (is_stamped) p.stamps[1] = global_timer();

    attention_run<T>(p, smem);
    grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, 2));
    if (is_stamped) p.stamps[2] = global_timer();

    g.a = static_cast<const T *>(p.attn);
    g.w = static_cast<const T *>(p.w_proj);
    g.bias = static_cast<const T *>(p.b_proj);
    g.ln_w = g.ln_b = nullptr;
    g.resid = static_cast<const T *>(p.x);
    g.out = static_cast<T *>(p.x1);
    g.n = C;
    g.splits = p.proj_splits;
    gemm_run<T>(g, M, smem, p.tile_counters, p.partials);
    grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, 3));
    if (is_stamped) p.stamps[3] = global_timer();

    g.a = static_cast<const T *>(p.x1);
    g.w = static_cast<const T *>(p.w_fc1);
    g.bias = static_cast<const T *>(p.b_fc1);
    g.ln_w = static_cast<const T *>(p.ln2_w);
    g.ln_b = static_cast<const T *>(p.ln2_b);
    g.resid = nullptr;
    g.out = static_cast<T *>(p.hidden);
    g.n = 4 * C;
    g.splits = 1;
    g.is_gelu = true;
    gemm_run<T>(g, M, smem, p.tile_counters, p.partials);
    grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, 4));
    if (is_stamped) p.stamps[4] = global_timer();

    g.a = static_cast<const T *>(p.hidden);
    g.lda = 4 * C;
    g.w = static_cast<const T *>(p.w_fc2);
    g.bias = static_cast<const T *>(p.b_fc2);
    g.ln_w = g.ln_b = nullptr;
    g.resid = static_cast<const T *>(p.x1);
    g.out = static_cast<T *>(p.out);
    g.n = C;
    g.k = 4 * C;
    g.splits = p.fc2_splits;
    g.is_gelu = false;
    gemm_run<T>(g, M, smem, p.tile_counters, p.partials);
    if (p.stamps != nullptr) { /* only a timed launch waits for the last stage */
        grid_barrier(p.barrier, p.barrier_kind, arrival_slot(p, 5));
        if (is_stamped) p.stamps[5] = global_timer();
    }
}

// ---- launcher ----

enum dtype_id { kF16 = RAGVIT_DTYPE_F16, kBF16 = RAGVIT_DTYPE_BF16 };

static const void *kernel_of(int dtype) {
    return dtype == kF16 ? reinterpret_cast<const void *>(fused_block_kernel<__half>)
                         : reinterpret_cast<const void *>(fused_block_kernel<__nv_bfloat16>);
}

/* K splits of a residual GEMM: the most (up to 8, dividing K / 64) whose items still fit one
 * pass of the grid, and at least enough that a split's K fits the A panel. */
static int fused_block_splits(int k, int tiles, int grid) {
    const int k_tiles = k / kTileK;
    int least = 0, best = 0;
    for (int d = 1; d <= k_tiles; ++d) {
        if (k_tiles % d != 0 || k / d > kMaxPanelK) continue;
        if (least == 0) least = d;
        if (d <= 8 && tiles * d <= grid) best = d;
    }
    return best > 0 ? best : least;
}

static cudaError_t fused_block_launch(const fused_block_params &p, int dtype, int grid,
                                      cudaStream_t stream) {
    void *args[] = {const_cast<fused_block_params *>(&p)};
    return cudaLaunchCooperativeKernel(kernel_of(dtype), dim3((unsigned)grid), dim3(kThreads), args,
                                       (size_t)kSmemBytes, stream);
}

// ---- C entry points of the library build (-DFUSED_BLOCK_LIBRARY, dev/fused_block_check.py) ----

extern "C" {

/* sizeof(fused_block_params), for the caller's mirror of the struct. */
size_t fused_block_params_size(void) { return sizeof(fused_block_params); }

/* CTAs an SM for dtype (0 fp16, 1 bf16; at most 2, the launch bounds), after opting in to
 * the kernel's dynamic shared memory; a negative cudaError_t on failure. */
int fused_block_occupancy(int dtype) {
    if (dtype != kF16 && dtype != kBF16) return -(int)cudaErrorInvalidValue;
    cudaError_t e = cudaFuncSetAttribute(kernel_of(dtype),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    int n = 0;
    if (e == cudaSuccess) {
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel_of(dtype), kThreads,
                                                          kSmemBytes);
    }
    return e == cudaSuccess ? std::min(n, 2) : -(int)e;
}

/* The K splits the driver picks for a residual GEMM of K = k over total_tokens rows of
 * channels columns on grid CTAs. */
int fused_block_split_count(int k, int total_tokens, int channels, int grid) {
    const int tiles = (total_tokens + kTileM - 1) / kTileM * (channels / kTileN);
    return fused_block_splits(k, tiles, grid);
}

/* One launch on stream; the cudaError_t of the launch. */
int fused_block_run(const fused_block_params *p, int dtype, int grid, void *stream) {
    return (int)fused_block_launch(*p, dtype, grid, static_cast<cudaStream_t>(stream));
}

} /* extern "C" */

#ifndef FUSED_BLOCK_LIBRARY

// ---- host reference ----

static const uint16_t kPoison16 = 0xFFFFu; /* NaN in fp16 and in bf16 */

struct block_case {
    std::string name;
    int dtype;
    int channels, num_heads;
    std::vector<int> cu; /* cu_seqlens */
    uint32_t seed;
};

/* Inputs and weights as the dtype's bits, and the same values as doubles. */
struct block_data {
    int C = 0, H = 0, M = 0;
    std::vector<uint16_t> x, ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_w, ln2_b, w_fc1, b_fc1,
        w_fc2, b_fc2;
};

static block_data make_data(const block_case &c) {
    block_data d;
    d.C = c.channels;
    d.H = c.num_heads;
    d.M = c.cu.back();
    std::mt19937 rng(c.seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    auto fill = [&](std::vector<uint16_t> *v, size_t n, double mean, double sd) {
        v->resize(n);
        for (auto &e : *v) e = to_bits(mean + sd * normal(rng), c.dtype);
    };
    const size_t C = (size_t)d.C;
    fill(&d.x, (size_t)d.M * C, 0.0, 1.0);
    fill(&d.ln1_w, C, 1.0, 0.1);
    fill(&d.ln1_b, C, 0.0, 0.1);
    fill(&d.w_qkv, 3 * C * C, 0.0, 1.0 / sqrt((double)C));
    fill(&d.b_qkv, 3 * C, 0.0, 0.1);
    fill(&d.w_proj, C * C, 0.0, 1.0 / sqrt((double)C));
    fill(&d.b_proj, C, 0.0, 0.1);
    fill(&d.ln2_w, C, 1.0, 0.1);
    fill(&d.ln2_b, C, 0.0, 0.1);
    fill(&d.w_fc1, 4 * C * C, 0.0, 1.0 / sqrt((double)C));
    fill(&d.b_fc1, 4 * C, 0.0, 0.1);
    fill(&d.w_fc2, 4 * C * C, 0.0, 1.0 / sqrt(4.0 * (double)C));
    fill(&d.b_fc2, C, 0.0, 0.1);
    return d;
}

static std::vector<double> to_double(const std::vector<uint16_t> &v, int dtype) {
    std::vector<double> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = from_bits(v[i], dtype);
    return r;
}

/* Runs f(i) for i in [0, n) on up to 32 threads. */
static void parallel_for(int n, const std::function<void(int)> &f) {
    unsigned nt = std::thread::hardware_concurrency();
    nt = nt == 0 ? 4 : (nt > 32 ? 32 : nt);
    nt = std::min<unsigned>(nt, (unsigned)std::max(n, 1));
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < nt; ++t)
        pool.emplace_back([&, t] {
            for (int i = (int)t; i < n; i += (int)nt) f(i);
        });
    for (auto &t : pool) t.join();
}

/* The block, one sequence at a time, in float64. With is_rounded, values are rounded to the
 * dtype where the kernel rounds them (LN outputs, qkv, the softmax numerators P before P V,
 * the attention output, x1, the GELU output, out), and nowhere else: the distance of that
 * result from the float64 one is what the dtype alone costs, and sets the tolerance. */
static std::vector<double> block_reference(const block_case &c, const block_data &d,
                                           bool is_rounded) {
    const int C = d.C, H = d.H, M = d.M, D = kHeadDim;
    auto rnd = [&](double v) { return is_rounded ? from_bits(to_bits(v, c.dtype), c.dtype) : v; };
    const std::vector<double> x = to_double(d.x, c.dtype);
    const std::vector<double> ln1_w = to_double(d.ln1_w, c.dtype),
                              ln1_b = to_double(d.ln1_b, c.dtype);
    const std::vector<double> w_qkv = to_double(d.w_qkv, c.dtype),
                              b_qkv = to_double(d.b_qkv, c.dtype);
    const std::vector<double> w_proj = to_double(d.w_proj, c.dtype),
                              b_proj = to_double(d.b_proj, c.dtype);
    const std::vector<double> ln2_w = to_double(d.ln2_w, c.dtype),
                              ln2_b = to_double(d.ln2_b, c.dtype);
    const std::vector<double> w_fc1 = to_double(d.w_fc1, c.dtype),
                              b_fc1 = to_double(d.b_fc1, c.dtype);
    const std::vector<double> w_fc2 = to_double(d.w_fc2, c.dtype),
                              b_fc2 = to_double(d.b_fc2, c.dtype);
    auto layer_norm = [&](const double *in, const std::vector<double> &w,
                          const std::vector<double> &b, double *o) {
        double mean = 0.0, var = 0.0;
        for (int k = 0; k < C; ++k) mean += in[k];
        mean /= C;
        for (int k = 0; k < C; ++k) var += (in[k] - mean) * (in[k] - mean);
        const double rstd = 1.0 / sqrt(var / C + 1e-6);
        for (int k = 0; k < C; ++k) o[k] = rnd((in[k] - mean) * rstd * w[k] + b[k]);
    };
    /* y[n] = a . W[n] + b[n] for a W of (N, K) */
    auto linear = [](const double *a, const std::vector<double> &w, const std::vector<double> &b,
                     int n_out, int k_in, double *y) {
        for (int n = 0; n < n_out; ++n) {
            const double *wr = &w[(size_t)n * k_in];
            double acc = 0.0;
            for (int k = 0; k < k_in; ++k) acc += a[k] * wr[k];
            y[n] = acc + b[(size_t)n];
        }
    };
    std::vector<double> qkv((size_t)M * 3 * C), attn((size_t)M * C), x1((size_t)M * C),
        out((size_t)M * C);
    parallel_for(M, [&](int t) {
        std::vector<double> xn((size_t)C);
        layer_norm(&x[(size_t)t * C], ln1_w, ln1_b, xn.data());
        linear(xn.data(), w_qkv, b_qkv, 3 * C, C, &qkv[(size_t)t * 3 * C]);
        for (int n = 0; n < 3 * C; ++n)
            qkv[(size_t)t * 3 * C + n] = rnd(qkv[(size_t)t * 3 * C + n]);
    });
    const int S = (int)c.cu.size() - 1;
    parallel_for(S * H, [&](int i) {
        const int s = i / H, h = i % H, start = c.cu[s], len = c.cu[s + 1] - c.cu[s];
        std::vector<double> logits((size_t)len);
        for (int qi = 0; qi < len; ++qi) {
            const double *q = &qkv[(size_t)(start + qi) * 3 * C + h * D];
            double mx = -INFINITY;
            for (int j = 0; j < len; ++j) {
                const double *k = &qkv[(size_t)(start + j) * 3 * C + C + h * D];
                double acc = 0.0;
                for (int e = 0; e < D; ++e) acc += q[e] * k[e];
                logits[(size_t)j] = acc / sqrt((double)D);
                mx = std::max(mx, logits[(size_t)j]);
            }
            double sum = 0.0;
            for (int j = 0; j < len; ++j) {
                logits[(size_t)j] = exp(logits[(size_t)j] - mx);
                sum += logits[(size_t)j];
            }
            double *o = &attn[(size_t)(start + qi) * C + h * D];
            for (int e = 0; e < D; ++e) o[e] = 0.0;
            for (int j = 0; j < len; ++j) {
                const double pj = rnd(logits[(size_t)j]);
                const double *v = &qkv[(size_t)(start + j) * 3 * C + 2 * C + h * D];
                for (int e = 0; e < D; ++e) o[e] += pj * v[e];
            }
            for (int e = 0; e < D; ++e) o[e] = rnd(o[e] / sum);
        }
    });
    parallel_for(M, [&](int t) {
        std::vector<double> y((size_t)C), xn((size_t)C), hid((size_t)4 * C);
        linear(&attn[(size_t)t * C], w_proj, b_proj, C, C, y.data());
        double *x1r = &x1[(size_t)t * C];
        for (int n = 0; n < C; ++n) x1r[n] = rnd(x[(size_t)t * C + n] + y[(size_t)n]);
        layer_norm(x1r, ln2_w, ln2_b, xn.data());
        linear(xn.data(), w_fc1, b_fc1, 4 * C, C, hid.data());
        for (auto &v : hid) v = rnd(0.5 * v * (1.0 + erf(v / sqrt(2.0))));
        linear(hid.data(), w_fc2, b_fc2, C, 4 * C, y.data());
        for (int n = 0; n < C; ++n) out[(size_t)t * C + n] = rnd(x1r[n] + y[(size_t)n]);
    });
    return out;
}

/* The same block written another way, for --cpu-selftest: sequences padded to the longest
 * into a (S, L, C) batch, attention over the whole padded row with a key mask and softmax
 * through log-sum-exp, LayerNorm variance as E[x^2] - mean^2, GELU through erfc, weights
 * applied column by column. Float64 throughout. */
static std::vector<double> block_reference_padded(const block_case &c, const block_data &d) {
    const int C = d.C, H = d.H, D = kHeadDim, S = (int)c.cu.size() - 1;
    int L = 0;
    for (int s = 0; s < S; ++s) L = std::max(L, c.cu[s + 1] - c.cu[s]);
    const size_t rows = (size_t)S * L;
    auto dbl = [&](const std::vector<uint16_t> &v) { return to_double(v, c.dtype); };
    const std::vector<double> w_qkv = dbl(d.w_qkv), w_proj = dbl(d.w_proj), w_fc1 = dbl(d.w_fc1),
                              w_fc2 = dbl(d.w_fc2);
    std::vector<double> xp(rows * C, 0.0);
    std::vector<char> is_real(rows, 0);
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < c.cu[s + 1] - c.cu[s]; ++i) {
            is_real[(size_t)s * L + i] = 1;
            for (int k = 0; k < C; ++k)
                xp[((size_t)s * L + i) * C + k] =
                    from_bits(d.x[(size_t)(c.cu[s] + i) * C + k], c.dtype);
        }
    auto norm = [&](const std::vector<double> &in, const std::vector<uint16_t> &w,
                    const std::vector<uint16_t> &b) {
        std::vector<double> o(in.size());
        for (size_t r = 0; r < rows; ++r) {
            double s1 = 0.0, s2 = 0.0;
            for (int k = 0; k < C; ++k) {
                s1 += in[r * C + k];
                s2 += in[r * C + k] * in[r * C + k];
            }
            const double mean = s1 / C, var = s2 / C - mean * mean;
            for (int k = 0; k < C; ++k)
                o[r * C + k] =
                    (in[r * C + k] - mean) / sqrt(var + 1e-6) * from_bits(w[(size_t)k], c.dtype) +
                    from_bits(b[(size_t)k], c.dtype);
        }
        return o;
    };
    /* (rows, K) x W^T + b, accumulated one input column at a time */
    auto matmul = [&](const std::vector<double> &a, const std::vector<double> &w,
                      const std::vector<uint16_t> &b, int n_out, int k_in) {
        std::vector<double> y(rows * n_out);
        parallel_for((int)rows, [&](int r) {
            double *yr = &y[(size_t)r * n_out];
            for (int n = 0; n < n_out; ++n) yr[n] = 0.0;
            for (int k = 0; k < k_in; ++k) {
                const double av = a[(size_t)r * k_in + k];
                for (int n = 0; n < n_out; ++n) yr[n] += av * w[(size_t)n * k_in + k];
            }
            for (int n = 0; n < n_out; ++n) yr[n] += from_bits(b[(size_t)n], c.dtype);
        });
        return y;
    };
    const std::vector<double> qkv = matmul(norm(xp, d.ln1_w, d.ln1_b), w_qkv, d.b_qkv, 3 * C, C);
    std::vector<double> attn(rows * C, 0.0);
    parallel_for(S * H, [&](int i) {
        const int s = i / H, h = i % H;
        std::vector<double> sc((size_t)L);
        for (int qi = 0; qi < L; ++qi) {
            const size_t qr = (size_t)s * L + qi;
            for (int j = 0; j < L; ++j) {
                const size_t kr = (size_t)s * L + j;
                double acc = 0.0;
                for (int e = 0; e < D; ++e)
                    acc += qkv[qr * 3 * C + h * D + e] * qkv[kr * 3 * C + C + h * D + e];
                sc[(size_t)j] = is_real[kr] ? acc / sqrt((double)D) : -INFINITY;
            }
            double mx = -INFINITY, lse = 0.0;
            for (double v : sc) mx = std::max(mx, v);
            for (double v : sc) lse += exp(v - mx);
            lse = mx + log(lse);
            for (int j = 0; j < L; ++j) {
                const double pj = exp(sc[(size_t)j] - lse);
                for (int e = 0; e < D; ++e)
                    attn[qr * C + h * D + e] +=
                        pj * qkv[((size_t)s * L + j) * 3 * C + 2 * C + h * D + e];
            }
        }
    });
    std::vector<double> x1 = matmul(attn, w_proj, d.b_proj, C, C);
    for (size_t i = 0; i < x1.size(); ++i) x1[i] += xp[i];
    std::vector<double> hid = matmul(norm(x1, d.ln2_w, d.ln2_b), w_fc1, d.b_fc1, 4 * C, C);
    for (auto &v : hid) v = 0.5 * v * erfc(-v / sqrt(2.0));
    std::vector<double> y = matmul(hid, w_fc2, d.b_fc2, C, 4 * C);
    std::vector<double> out((size_t)d.M * C);
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < c.cu[s + 1] - c.cu[s]; ++i)
            for (int k = 0; k < C; ++k) {
                const size_t r = ((size_t)s * L + i) * C + k;
                out[(size_t)(c.cu[s] + i) * C + k] = x1[r] + y[r];
            }
    return out;
}

// ---- checks ----

enum { kGuardRows = 8 };

/* The rule: err = max |got - ref64| over the valid rows must satisfy
 * err <= 2 * err_rounded + floor, where err_rounded is max |rounded - ref64| of the
 * reference rounded at the kernel's points (block_reference with is_rounded) and floor is
 * 1e-3 (fp16) or 8e-3 (bf16); any non-finite value fails, and the guard rows after the
 * output must still hold the NaN poison bit for bit. */
struct check_result {
    double max_err = 0.0, tol = 0.0;
    int64_t bad_values = 0, bad_guard = 0;
};

static check_result check_output(const block_case &c, const std::vector<uint16_t> &got,
                                 const std::vector<double> &ref,
                                 const std::vector<double> &rounded) {
    check_result r;
    double rounded_err = 0.0;
    for (size_t i = 0; i < ref.size(); ++i)
        rounded_err = std::max(rounded_err, fabs(rounded[i] - ref[i]));
    r.tol = 2.0 * rounded_err + (c.dtype == kF16 ? 1e-3 : 8e-3);
    for (size_t i = 0; i < ref.size(); ++i) {
        const double v = from_bits(got[i], c.dtype), err = fabs(v - ref[i]);
        if (!std::isfinite(v) || !(err <= r.tol)) ++r.bad_values;
        if (std::isfinite(err)) r.max_err = std::max(r.max_err, err);
    }
    for (size_t i = ref.size(); i < got.size(); ++i)
        if (got[i] != kPoison16) ++r.bad_guard;
    return r;
}

// ---- GPU driver ----

struct device_block {
    int dtype = kF16, C = 0, H = 0, M = 0, S = 0, max_seqlen = 0;
    void *x = nullptr, *out = nullptr, *weights = nullptr, *qkv = nullptr, *attn = nullptr,
         *x1 = nullptr, *hidden = nullptr;
    float *partials = nullptr;
    unsigned *counters = nullptr, *barrier = nullptr;
    int *cu = nullptr;
    size_t partial_bytes = 0;
    fused_block_params p;
};

/* What the kernel supports: C = 64 H up to kMaxPanelK, lengths that sum to T. */
static bool fused_block_supports(const block_case &c) {
    bool is_ok = c.channels % kTileN == 0 && c.channels <= kMaxPanelK &&
                 c.channels == c.num_heads * kHeadDim && c.cu.size() >= 2 && c.cu[0] == 0;
    for (size_t s = 0; s + 1 < c.cu.size(); ++s) is_ok = is_ok && c.cu[s + 1] >= c.cu[s];
    return is_ok && c.cu.back() > 0;
}

static device_block upload(const block_case &c, const block_data &d, int grid) {
    if (!fused_block_supports(c)) {
        fprintf(stderr, "fused_block: unsupported case %s\n", c.name.c_str());
        exit(2);
    }
    device_block b;
    b.dtype = c.dtype;
    b.C = d.C;
    b.H = d.H;
    b.M = d.M;
    b.S = (int)c.cu.size() - 1;
    for (int s = 0; s < b.S; ++s) b.max_seqlen = std::max(b.max_seqlen, c.cu[s + 1] - c.cu[s]);
    const size_t C = (size_t)d.C, M = (size_t)d.M;
    CHECK_CUDA(cudaMalloc(&b.x, M * C * 2));
    CHECK_CUDA(cudaMemcpy(b.x, d.x.data(), M * C * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&b.out, (M + kGuardRows) * C * 2));
    const std::vector<uint16_t> *parts[] = {&d.ln1_w,  &d.ln1_b,  &d.w_qkv, &d.b_qkv,
                                            &d.w_proj, &d.b_proj, &d.ln2_w, &d.ln2_b,
                                            &d.w_fc1,  &d.b_fc1,  &d.w_fc2, &d.b_fc2};
    size_t total = 0;
    for (auto *v : parts) total += (v->size() * 2 + 255) / 256 * 256;
    CHECK_CUDA(cudaMalloc(&b.weights, total));
    const void *ptrs[12];
    size_t off = 0;
    for (int i = 0; i < 12; ++i) {
        char *dst = static_cast<char *>(b.weights) + off;
        CHECK_CUDA(cudaMemcpy(dst, parts[i]->data(), parts[i]->size() * 2, cudaMemcpyHostToDevice));
        ptrs[i] = dst;
        off += (parts[i]->size() * 2 + 255) / 256 * 256;
    }
    CHECK_CUDA(cudaMalloc(&b.qkv, M * 3 * C * 2));
    CHECK_CUDA(cudaMalloc(&b.attn, M * C * 2));
    CHECK_CUDA(cudaMalloc(&b.x1, M * C * 2));
    CHECK_CUDA(cudaMalloc(&b.hidden, M * 4 * C * 2));
    const int tiles = (int)((M + kTileM - 1) / kTileM) * (int)(C / kTileN);
    const int proj_splits = fused_block_splits((int)C, tiles, grid);
    const int fc2_splits = fused_block_splits(4 * (int)C, tiles, grid);
    b.partial_bytes = (size_t)std::max(proj_splits, fc2_splits) * M * C * 4;
    CHECK_CUDA(cudaMalloc(&b.partials, b.partial_bytes));
    CHECK_CUDA(cudaMalloc(&b.counters, (size_t)tiles * 4));
    CHECK_CUDA(cudaMemset(b.counters, 0, (size_t)tiles * 4));
    CHECK_CUDA(cudaMalloc(&b.barrier, 16));
    CHECK_CUDA(cudaMemset(b.barrier, 0, 16));
    CHECK_CUDA(cudaMalloc(&b.cu, c.cu.size() * 4));
    CHECK_CUDA(cudaMemcpy(b.cu, c.cu.data(), c.cu.size() * 4, cudaMemcpyHostToDevice));
    fused_block_params &p = b.p;
    memset(&p, 0, sizeof p);
    p.out = b.out;
    p.x = b.x;
    p.ln1_w = ptrs[0];
    p.ln1_b = ptrs[1];
    p.w_qkv = ptrs[2];
    p.b_qkv = ptrs[3];
    p.w_proj = ptrs[4];
    p.b_proj = ptrs[5];
    p.ln2_w = ptrs[6];
    p.ln2_b = ptrs[7];
    p.w_fc1 = ptrs[8];
    p.b_fc1 = ptrs[9];
    p.w_fc2 = ptrs[10];
    p.b_fc2 = ptrs[11];
    p.qkv = b.qkv;
    p.attn = b.attn;
    p.x1 = b.x1;
    p.hidden = b.hidden;
    p.partials = b.partials;
    p.tile_counters = b.counters;
    p.barrier = b.barrier;
    p.stamps = nullptr;
    p.cu_seqlens = b.cu;
    p.num_seqs = b.S;
    p.total_tokens = b.M;
    p.channels = b.C;
    p.num_heads = b.H;
    p.max_seqlen = b.max_seqlen;
    p.proj_splits = proj_splits;
    p.fc2_splits = fc2_splits;
    p.scale_log2 = (float)(1.4426950408889634 / sqrt((double)kHeadDim));
    return b;
}

static void release(device_block *b) {
    void *ptrs[] = {b->x,      b->out,      b->weights,  b->qkv,     b->attn, b->x1,
                    b->hidden, b->partials, b->counters, b->barrier, b->cu};
    for (void *q : ptrs) CHECK_CUDA(cudaFree(q));
}

/* Poisons the output (guard rows included) and every scratch buffer, launches, and reads the
 * output back with its guard rows. */
static std::vector<uint16_t> run_block(const device_block &b, int grid) {
    const size_t C = (size_t)b.C, M = (size_t)b.M;
    CHECK_CUDA(cudaMemset(b.out, 0xFF, (M + kGuardRows) * C * 2));
    CHECK_CUDA(cudaMemset(b.qkv, 0xFF, M * 3 * C * 2));
    CHECK_CUDA(cudaMemset(b.attn, 0xFF, M * C * 2));
    CHECK_CUDA(cudaMemset(b.x1, 0xFF, M * C * 2));
    CHECK_CUDA(cudaMemset(b.hidden, 0xFF, M * 4 * C * 2));
    CHECK_CUDA(cudaMemset(b.partials, 0xFF, b.partial_bytes));
    CHECK_CUDA(fused_block_launch(b.p, b.dtype, grid, nullptr));
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> out((M + kGuardRows) * C);
    CHECK_CUDA(cudaMemcpy(out.data(), b.out, out.size() * 2, cudaMemcpyDeviceToHost));
    return out;
}

static int g_grid[2] = {0, 0}; /* per dtype: SMs x CTAs an SM, or --grid */
enum { kSmallGrid = 5 };       /* a grid far below the items: every CTA loops over many */

/* Runs the case on the full grid and on kSmallGrid CTAs (the split counts follow the grid),
 * each launch twice: every output must pass the check and each pair must be bit-identical. */
static int run_case(const block_case &c) {
    const block_data d = make_data(c);
    const std::vector<double> ref = block_reference(c, d, false);
    const std::vector<double> rounded = block_reference(c, d, true);
    check_result worst;
    bool is_deterministic = true;
    char splits[64] = "";
    const int grids[2] = {g_grid[c.dtype], std::min<int>(kSmallGrid, g_grid[c.dtype])};
    for (int grid : grids) {
        device_block b = upload(c, d, grid);
        const std::vector<uint16_t> got = run_block(b, grid);
        const std::vector<uint16_t> again = run_block(b, grid);
        b.p.barrier_kind = kFlipBarrier; /* the same sums in the same order: the same bits */
        const std::vector<uint16_t> flip = run_block(b, grid);
        b.p.barrier_kind = kGenerationBarrier;
        const check_result r = check_output(c, got, ref, rounded);
        if (r.bad_values || r.bad_guard || got != again || got != flip)
            printf("    ^ grid %d, splits %d/%d: bad_values=%lld bad_guard=%lld%s%s\n", grid,
                   b.p.proj_splits, b.p.fc2_splits, (long long)r.bad_values, (long long)r.bad_guard,
                   got == again ? "" : " NOT BIT-IDENTICAL",
                   got == flip ? "" : " FLIP BARRIER DIFFERS");
        is_deterministic = is_deterministic && got == again && got == flip;
        worst.max_err = std::max(worst.max_err, r.max_err);
        worst.tol = r.tol;
        worst.bad_values += r.bad_values;
        worst.bad_guard += r.bad_guard;
        snprintf(splits + strlen(splits), sizeof splits - strlen(splits), "%s%d:%d/%d",
                 splits[0] ? " " : "", grid, b.p.proj_splits, b.p.fc2_splits);
        release(&b);
    }
    const bool is_ok = worst.bad_values == 0 && worst.bad_guard == 0 && is_deterministic;
    printf("%-4s %-26s %s C=%3d H=%2d T=%5d S=%2d grid:splits %-14s max_err=%.3e  tol=%.3e  "
           "seed=%u\n",
           is_ok ? "ok" : "FAIL", c.name.c_str(), c.dtype == kF16 ? "f16 " : "bf16", c.channels,
           c.num_heads, (int)c.cu.back(), (int)c.cu.size() - 1, splits, worst.max_err, worst.tol,
           c.seed);
    fflush(stdout);
    return is_ok ? 0 : 1;
}

static block_case make_case(const std::string &name, int dtype, int C, const std::vector<int> &lens,
                            uint32_t seed) {
    block_case c;
    c.name = name;
    c.dtype = dtype;
    c.channels = C;
    c.num_heads = C / kHeadDim;
    c.cu.push_back(0);
    for (int len : lens) c.cu.push_back(c.cu.back() + len);
    c.seed = seed;
    return c;
}

/* GPU us per launch (median of 7 x 200 back-to-back launches, L2 warm; "barriers" is a launch
 * of the barriers alone, the floor under each stage; "flip" columns use kFlipBarrier, the others
 * kGenerationBarrier), then 200 launches
 * with CTA 0's %globaltimer stamps at each barrier, averaged per stage. */
static void bench(int sm_count) {
    struct shape {
        const char *name;
        int C, batch, len;
        int is_barriers_only; /* the launch's barriers alone, on the grid of the others */
        int barrier_kind;
    };
    const shape shapes[] = {{"deit-s 1x99", 384, 1, 99, 0, kGenerationBarrier},
                            {"deit-b 1x99", 768, 1, 99, 0, kGenerationBarrier},
                            {"deit-s 4x99", 384, 4, 99, 0, kGenerationBarrier},
                            {"barriers", 384, 1, 99, 1, kGenerationBarrier},
                            {"s 1x99 flip", 384, 1, 99, 0, kFlipBarrier},
                            {"b 1x99 flip", 768, 1, 99, 0, kFlipBarrier},
                            {"barriers flip", 384, 1, 99, 1, kFlipBarrier}};
    const char *stage_names[] = {"LN1 + qkv", "attention", "proj + residual", "LN2 + fc1 + GELU",
                                 "fc2 + residual"};
    std::vector<std::vector<double>> stage_us, until_us, barrier_us;
    printf("bench (fp16, GPU us per launch, median of 7 x 200 launches, L2 warm):\n");
    for (const shape &sh : shapes) {
        const block_case c =
            make_case(sh.name, kF16, sh.C, std::vector<int>((size_t)sh.batch, sh.len), 7);
        const block_data d = make_data(c);
        const int grid = g_grid[kF16];
        device_block b = upload(c, d, grid);
        b.p.is_barriers_only = sh.is_barriers_only;
        b.p.barrier_kind = sh.barrier_kind;
        cudaEvent_t e0, e1;
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
        for (int i = 0; i < 50; ++i) CHECK_CUDA(fused_block_launch(b.p, kF16, grid, nullptr));
        CHECK_CUDA(cudaGetLastError());
        std::vector<float> reps;
        for (int r = 0; r < 7; ++r) {
            CHECK_CUDA(cudaEventRecord(e0));
            for (int i = 0; i < 200; ++i) CHECK_CUDA(fused_block_launch(b.p, kF16, grid, nullptr));
            CHECK_CUDA(cudaEventRecord(e1));
            CHECK_CUDA(cudaEventSynchronize(e1));
            CHECK_CUDA(cudaGetLastError());
            float ms = 0.0f;
            CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            reps.push_back(ms * 1000.0f / 200.0f);
        }
        std::sort(reps.begin(), reps.end());
        const double C = sh.C, M = (double)b.M;
        const double work = sh.is_barriers_only ? 0.0 : 1.0; /* a barriers row does none */
        const double flops =
            work * (2.0 * M * 12.0 * C * C + 4.0 * sh.batch * (double)sh.len * sh.len * C);
        const double weight_bytes = work * 2.0 * (12.0 * C * C + 13.0 * C);
        printf("  %-13s T=%4d grid %d CTAs on %d SMs, splits %d/%d  %7.2f us (p0 %.2f, p100 "
               "%.2f)  %.3f GFLOP  %.2f MB weights\n",
               sh.name, b.M, grid, sm_count, b.p.proj_splits, b.p.fc2_splits, reps[3], reps[0],
               reps[6], flops * 1e-9, weight_bytes * 1e-6);
        const int n = 200;
        const size_t per_launch = (size_t)grid * kNumStamps;
        unsigned long long *stamps = nullptr, *arrivals = nullptr;
        CHECK_CUDA(cudaMalloc(&stamps, (size_t)n * kNumStamps * 8));
        CHECK_CUDA(cudaMalloc(&arrivals, (size_t)n * per_launch * 8));
        for (int i = 0; i < n; ++i) {
            fused_block_params p = b.p;
            p.stamps = stamps + (size_t)i * kNumStamps;
            p.arrivals = arrivals + (size_t)i * per_launch;
            CHECK_CUDA(fused_block_launch(p, kF16, grid, nullptr));
        }
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<unsigned long long> h((size_t)n * kNumStamps), ha((size_t)n * per_launch);
        CHECK_CUDA(cudaMemcpy(h.data(), stamps, h.size() * 8, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(ha.data(), arrivals, ha.size() * 8, cudaMemcpyDeviceToHost));
        std::vector<double> us(kNumStamps, 0.0), until(kNumStamps - 1, 0.0),
            release_us(kNumStamps - 1, 0.0);
        for (int i = 0; i < n; ++i) {
            const unsigned long long *t = &h[(size_t)i * kNumStamps];
            for (int s = 0; s + 1 < kNumStamps; ++s) {
                us[(size_t)s] += (double)(t[s + 1] - t[s]);
                /* the last CTA to arrive at barrier s + 1 bounds the stage's work; from then
                 * to CTA 0's stamp after it is the barrier's own latency */
                unsigned long long last = 0;
                for (int cta = 0; cta < grid; ++cta)
                    last = std::max(
                        last,
                        ha[(size_t)i * per_launch + (size_t)cta * kNumStamps + (size_t)s + 1]);
                until[(size_t)s] += (double)(long long)(last - t[s]);
                release_us[(size_t)s] += (double)(long long)(t[s + 1] - last);
            }
            us[kNumStamps - 1] += (double)(t[kNumStamps - 1] - t[0]);
        }
        for (auto *v : {&us, &until, &release_us})
            for (auto &x : *v) x = x / n / 1000.0;
        stage_us.push_back(us);
        until_us.push_back(until);
        barrier_us.push_back(release_us);
        CHECK_CUDA(cudaFree(stamps));
        CHECK_CUDA(cudaFree(arrivals));
        CHECK_CUDA(cudaEventDestroy(e0));
        CHECK_CUDA(cudaEventDestroy(e1));
        release(&b);
    }
    printf("per stage (us, mean of 200 stamped launches: CTA 0's %%globaltimer from one barrier "
           "to the next, a barrier's wait included; stamped launches add a last barrier):\n");
    printf("  %-18s", "stage");
    for (const shape &sh : shapes) printf(" %13s", sh.name);
    printf("\n");
    for (int s = 0; s < kNumStamps; ++s) {
        printf("  %-18s", s + 1 < kNumStamps ? stage_names[s] : "total (stamped)");
        for (const auto &us : stage_us) printf(" %13.2f", us[(size_t)s]);
        printf("\n");
    }
    printf("the same split at the last CTA's arrival (its warps done, before its atomic), us: "
           "work = CTA 0's previous stamp to the last arrival, barrier = last arrival to CTA 0's "
           "stamp after the barrier\n");
    printf("  %-18s %-8s", "stage", "part");
    for (const shape &sh : shapes) printf(" %13s", sh.name);
    printf("\n");
    for (int s = 0; s + 1 < kNumStamps; ++s) {
        for (int part = 0; part < 2; ++part) {
            printf("  %-18s %-8s", stage_names[s], part == 0 ? "work" : "barrier");
            for (const auto &us : part == 0 ? until_us : barrier_us)
                printf(" %13.2f", us[(size_t)s]);
            printf("\n");
        }
    }
}

// ---- CPU self-test ----

/* The float64 reference against the padded formulation, the rounded reference's distance
 * from it (non-zero, small), and the checker on outputs it must pass and must fail. */
static int cpu_selftest() {
    int failures = 0;
    const block_case cases[] = {make_case("small ragged", kF16, 128, {1, 37, 20}, 11),
                                make_case("deit-s ragged", kF16, 384, {1, 197, 50}, 12),
                                make_case("bf16 small", kBF16, 192, {17, 64, 3}, 13)};
    for (const block_case &c : cases) {
        const block_data d = make_data(c);
        const std::vector<double> ref = block_reference(c, d, false);
        const std::vector<double> alt = block_reference_padded(c, d);
        const std::vector<double> rounded = block_reference(c, d, true);
        double diff = 0.0, scale = 0.0, rounded_err = 0.0;
        for (size_t i = 0; i < ref.size(); ++i) {
            diff = std::max(diff, fabs(ref[i] - alt[i]));
            scale = std::max(scale, fabs(ref[i]));
            rounded_err = std::max(rounded_err, fabs(rounded[i] - ref[i]));
        }
        const bool is_ref_ok = std::isfinite(diff) && diff <= 1e-10 * std::max(scale, 1.0);
        const double ulp = c.dtype == kF16 ? 1.0 / 1024 : 1.0 / 128;
        const bool is_rounded_ok = rounded_err > 0.0 && rounded_err < 16.0 * ulp * scale;
        /* the checker: the rounded reference as output passes; one value off by 3x the
         * tolerance, a NaN, or a written guard row fails */
        std::vector<uint16_t> got(ref.size() + (size_t)kGuardRows * c.channels, kPoison16);
        for (size_t i = 0; i < ref.size(); ++i) got[i] = to_bits(rounded[i], c.dtype);
        const check_result pass = check_output(c, got, ref, rounded);
        std::vector<uint16_t> off = got, nan = got, guard = got;
        off[ref.size() / 2] = to_bits(ref[ref.size() / 2] + 3.0 * pass.tol, c.dtype);
        nan[7] = kPoison16;
        guard[ref.size() + 3] = to_bits(0.0, c.dtype);
        const bool is_checker_ok = pass.bad_values == 0 && pass.bad_guard == 0 &&
                                   check_output(c, off, ref, rounded).bad_values == 1 &&
                                   check_output(c, nan, ref, rounded).bad_values == 1 &&
                                   check_output(c, guard, ref, rounded).bad_guard == 1;
        const bool is_ok = is_ref_ok && is_rounded_ok && is_checker_ok;
        printf("%-4s cpu %-26s %s C=%3d T=%4d  |ref - padded| %.2e (max |ref| %.2f)  "
               "|rounded - ref| %.3e  checker %s\n",
               is_ok ? "ok" : "FAIL", c.name.c_str(), c.dtype == kF16 ? "f16 " : "bf16", c.channels,
               d.M, diff, scale, rounded_err, is_checker_ok ? "ok" : "WRONG");
        fflush(stdout);
        failures += is_ok ? 0 : 1;
    }
    return failures;
}

int main(int argc, char **argv) {
    bool is_quick = false, is_bench = false, is_cpu = false;
    int grid_override = 0; /* --grid: CTAs of the full grid (at most SMs x CTAs an SM) */
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--quick") == 0)
            is_quick = true;
        else if (strcmp(argv[i], "--bench") == 0)
            is_bench = true;
        else if (strcmp(argv[i], "--cpu-selftest") == 0)
            is_cpu = true;
        else if (strcmp(argv[i], "--grid") == 0 && i + 1 < argc)
            grid_override = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--quick] [--bench] [--grid CTAS] [--cpu-selftest]\n",
                    argv[0]);
            return 2;
        }
    }
    int num_devices = 0;
    if (!is_cpu && (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0)) {
        printf("FAIL: no CUDA device (--cpu-selftest checks the reference without one)\n");
        return 1;
    }
    int failures = 0;
    if (is_cpu) {
        failures = cpu_selftest();
    } else {
        int device = 0;
        CHECK_CUDA(cudaGetDevice(&device));
        cudaDeviceProp prop;
        CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
        if (!prop.cooperativeLaunch) {
            printf("FAIL: device %d cannot launch cooperative kernels\n", device);
            return 1;
        }
        const int per_sm[2] = {fused_block_occupancy(kF16), fused_block_occupancy(kBF16)};
        for (int n : per_sm) CHECK_CUDA(n < 0 ? (cudaError_t)-n : cudaSuccess);
        for (int t = 0; t < 2; ++t) {
            g_grid[t] = prop.multiProcessorCount * per_sm[t];
            if (grid_override > 0) g_grid[t] = std::min(g_grid[t], grid_override);
        }
        printf("device %d: %s (sm_%d%d, %d SMs); %d CTAs an SM (fp16), %d (bf16); grid %d; "
               "%d bytes of shared memory a CTA\n",
               device, prop.name, prop.major, prop.minor, prop.multiProcessorCount, per_sm[0],
               per_sm[1], g_grid[0], kSmemBytes);
        if (per_sm[0] < 1 || per_sm[1] < 1) {
            printf("FAIL: the kernel does not fit an SM\n");
            return 1;
        }
        uint32_t seed = 100;
        if (is_quick) {
            failures += run_case(make_case("small ragged", kF16, 128, {1, 37, 20}, seed++));
            failures += run_case(make_case("small", kBF16, 192, {17}, seed++));
        } else {
            for (int dtype : {kF16, kBF16}) {
                failures += run_case(make_case("deit-s 1x99", dtype, 384, {99}, seed++));
                failures +=
                    run_case(make_case("deit-s ragged 1,197,50", dtype, 384, {1, 197, 50}, seed++));
            }
            failures += run_case(make_case("deit-s 1x197", kF16, 384, {197}, seed++));
            failures += run_case(make_case("deit-s 4x99", kF16, 384, {99, 99, 99, 99}, seed++));
            failures +=
                run_case(make_case("deit-s 16x99", kF16, 384, std::vector<int>(16, 99), seed++));
            failures += run_case(
                make_case("deit-s ragged 16..130", kF16, 384, {16, 130, 17, 64, 65, 1}, seed++));
            failures += run_case(make_case("deit-b 1x99", kF16, 768, {99}, seed++));
            failures += run_case(make_case("deit-b 1x197", kF16, 768, {197}, seed++));
            failures += run_case(make_case("deit-b 4x99", kBF16, 768, {99, 99, 99, 99}, seed++));
        }
        if (is_bench && failures == 0) bench(prop.multiProcessorCount);
    }
    if (failures == 0) {
        printf("ALL PASS\n");
        return 0;
    }
    printf("FAIL: %d case(s)\n", failures);
    return 1;
}

#endif /* FUSED_BLOCK_LIBRARY */
