/* fused_ln_gemm.cu — dev probe, never packaged: a small-M fused LayerNorm -> GEMM (+bias)
 * (-> exact GELU) kernel for fp16/bf16, out (M, N) = E(round(LN(x)) . W^T + bias) with x (M, K)
 * rows of x_stride, W (N, K) contiguous (a torch Linear weight), out rows of out_stride; checked
 * against a float64 CPU reference, then timed against LN kernel + cuBLASLt (BIAS) [+ GELU kernel].
 * grid = (ceil(N / BN), ceil(M / BM)), 4 warps a block. A block cp.asyncs its whole BM x K slab
 * of x into padded shared rows (K + 8 elements: conflict-free ldmatrix) while the first W tiles
 * of its STAGES-deep ring stream in, normalizes the slab in place (a warp a row, two rows in
 * flight, float32 two-pass statistics, rounded to T like the unfused LN's output), then runs
 * mma.sync m16n8k16 over 64-wide K tiles of W (padded 72-element rows); bias and GELU in the
 * epilogue. Decision: every N-tile block recomputes its slab's LN (no second kernel, no
 * cross-block exchange); the tile configurations below are all compiled and the bench picks.
 * Build from the repository root (system cuBLASLt first, else the nvidia-cu13 pip wheel's):
 *   dev/build_fused_ln_gemm.sh          # -> ab/fused_ln_gemm.bin; VERBOSE=1 adds -Xptxas -v
 * which runs, for the wheel case (W = .../site-packages/nvidia/cu13, cublas*.h symlinked into a
 * private include dir so the toolkit's own runtime headers stay first):
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80
 *     -I<dir> dev/fused_ln_gemm.cu -o ab/fused_ln_gemm.bin -L$W/lib -l:libcublasLt.so.13
 *     -Xlinker -rpath,$W/lib
 * Run: ab/fused_ln_gemm.bin           correctness of every configuration (ALL PASS, else exit 1)
 *      ab/fused_ln_gemm.bin --bench   the same, then DeiT-S/B timings (fp16, CUDA graphs)
 *      add --cold to give each of the graph's 20 calls its own weight copy (W not L2-resident);
 *      --quick checks small cases only (for compute-sanitizer --tool memcheck / racecheck). */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

static constexpr int kThreads = 128;   /* 4 warps a block */
static constexpr int kWarps = kThreads / 32;
static constexpr int kBlockK = 64;     /* K per W tile */
static constexpr int kLdw = kBlockK + 8; /* padded W tile row (elements) */
static constexpr int kMaxInner = 1024; /* K domain: 64 <= K <= 1024, K % 64 == 0 */

enum dtype_id { DTYPE_F16 = 0, DTYPE_BF16 = 1 };
static const char *const kDtypeNames[2] = {"f16", "bf16"};

/* One fused call. Pointers are T (half or bfloat16) except where said. */
struct fused_ln_gemm_args {
    void *out;                /* (M, N) rows of out_stride */
    const void *x;            /* (M, K) rows of x_stride */
    const void *weight;       /* (N, K) contiguous */
    const void *bias;         /* (N,) or NULL */
    const void *gamma, *beta; /* (K,) each, read when has_ln (NULL: 1 and 0) */
    int rows, cols, inner;    /* M, N, K */
    int64_t x_stride, out_stride; /* elements */
    float eps;
    int has_ln, has_gelu;
};

// ---- device helpers ----

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; is_valid == false writes 16 zero bytes and reads nothing. */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool is_valid) {
    const int src_bytes = is_valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
                 : "memory");
}

static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are still in flight. */
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* Per-dtype pieces: pack two floats (lower column in the low half, rounded to nearest even),
 * unpack, one element to float, and c[0..3] += A (16x16, row) * B (16x8, col) in fp32. */
template <typename T>
struct elem;

template <>
struct elem<__half> {
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
    static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <>
struct elem<__nv_bfloat16> {
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
    static __device__ __forceinline__ float to_float(__nv_bfloat16 v) {
        return __bfloat162float(v);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float gelu_exact(float v) {
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

// ---- kernels ----

/* One W tile, rows [n0, n0 + BN) x columns [k0, k0 + 64), into a ring stage of BN padded
 * rows; rows >= N are zero-filled. Thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 j. */
template <typename T, int BN>
static __device__ __forceinline__ void fused_ln_gemm_load_w(T *stage, const T *w, int n0, int N,
                                                           int K, int k0, int tid) {
    const int chunk = tid % 8;
#pragma unroll
    for (int r = tid / 8; r < BN; r += kThreads / 8) {
        const bool is_valid = n0 + r < N;
        const T *src = w + (int64_t)(is_valid ? n0 + r : 0) * K + k0 + chunk * 8;
        cp_async16(smem_addr(stage + r * kLdw + chunk * 8), src, is_valid);
    }
}

/* In-place LayerNorm of slab rows [0, valid_rows) (rows of lda elements, K <= 128 kChunks
 * used): warp w takes rows w + 4 q, q < kRows, at once (kRows reductions in flight; the float
 * cache stays <= 64 registers), then the next 4 kRows rows; lane l holds 4-element chunks l,
 * l + 32, ... as floats between the passes. gamma, beta: (K,) float in shared memory. Rows
 * past valid_rows are left as they are (zeros: their outputs are never stored). */
template <typename T, int kChunks>
static __device__ __forceinline__ void fused_ln_gemm_normalize(T *sx, int lda,
                                                               const float *gamma,
                                                               const float *beta, int K,
                                                               int valid_rows, float eps,
                                                               int warp, int lane) {
    constexpr int kRows = kChunks <= 4 ? 4 : 2;
    const int num_chunks = K / 4;
    const float inv_k = 1.0f / (float)K;
    /* r0 = w + 4 kRows j < valid_rows <= BM with BM % 16 == 0, so every row r0 + 4 q of the
     * group is inside the slab */
    for (int r0 = warp; r0 < valid_rows; r0 += kRows * kWarps) {
        float v[kRows][kChunks][4];
        float mean[kRows], var[kRows];
#pragma unroll
        for (int q = 0; q < kRows; q++) {
            const T *row = sx + (r0 + q * kWarps) * lda;
            mean[q] = 0.0f;
#pragma unroll
            for (int i = 0; i < kChunks; i++) {
                const int c = lane + 32 * i;
                if (c < num_chunks) {
                    const uint2 u = *reinterpret_cast<const uint2 *>(row + 4 * c);
                    const float2 lo = elem<T>::unpack(u.x), hi = elem<T>::unpack(u.y);
                    v[q][i][0] = lo.x;
                    v[q][i][1] = lo.y;
                    v[q][i][2] = hi.x;
                    v[q][i][3] = hi.y;
                } else {
                    v[q][i][0] = v[q][i][1] = v[q][i][2] = v[q][i][3] = 0.0f;
                }
                mean[q] += (v[q][i][0] + v[q][i][1]) + (v[q][i][2] + v[q][i][3]);
            }
        }
#pragma unroll
        for (int q = 0; q < kRows; q++)
            mean[q] = warp_sum(mean[q]) * inv_k;
#pragma unroll
        for (int q = 0; q < kRows; q++) {
            var[q] = 0.0f;
#pragma unroll
            for (int i = 0; i < kChunks; i++) {
                const bool is_valid = lane + 32 * i < num_chunks;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    v[q][i][j] = is_valid ? v[q][i][j] - mean[q] : 0.0f;
                    var[q] += v[q][i][j] * v[q][i][j];
                }
            }
        }
#pragma unroll
        for (int q = 0; q < kRows; q++)
            var[q] = rsqrtf(warp_sum(var[q]) * inv_k + eps); /* now rstd */
#pragma unroll
        for (int q = 0; q < kRows; q++) {
            if (q > 0 && r0 + q * kWarps >= valid_rows)
                continue;
            T *row = sx + (r0 + q * kWarps) * lda;
#pragma unroll
            for (int i = 0; i < kChunks; i++) {
                const int c = lane + 32 * i;
                if (c >= num_chunks)
                    continue;
                const float4 g = *reinterpret_cast<const float4 *>(gamma + 4 * c);
                const float4 b = *reinterpret_cast<const float4 *>(beta + 4 * c);
                uint2 u;
                u.x = elem<T>::pack(fmaf(v[q][i][0] * var[q], g.x, b.x),
                                    fmaf(v[q][i][1] * var[q], g.y, b.y));
                u.y = elem<T>::pack(fmaf(v[q][i][2] * var[q], g.z, b.z),
                                    fmaf(v[q][i][3] * var[q], g.w, b.w));
                *reinterpret_cast<uint2 *>(row + 4 * c) = u;
            }
        }
    }
}

/* out tile [m0, m0 + BM) x [n0, n0 + BN). Warps form kWarpsM x kWarpsN, each owning a
 * kWm x kWn sub-tile (kMt m16 tiles x kNt n8 tiles). Shared memory: the x slab (BM rows of
 * K + 8), the W ring (STAGES x BN rows of 72), then gamma and beta as floats (2 K, with LN).
 * cp.async groups: slab, W tiles 0 .. STAGES-2, then one per main-loop step (empty ones too,
 * so wait_group counts stay uniform). */
template <typename T, int BM, int BN, int STAGES>
static __global__ void __launch_bounds__(kThreads)
    fused_ln_gemm_kernel(const fused_ln_gemm_args a) {
    constexpr int kWarpsM = BM >= 32 ? 2 : 1, kWarpsN = kWarps / kWarpsM;
    constexpr int kWm = BM / kWarpsM, kWn = BN / kWarpsN;
    constexpr int kMt = kWm / 16, kNt = kWn / 8;
    static_assert(BM % 16 == 0 && kWm % 16 == 0 && kWn % 16 == 0, "warp tile must be m16 x n16k");
    static_assert(STAGES >= 2, "the W ring needs two stages");
    extern __shared__ __align__(16) unsigned char smem[];
    const int K = a.inner, lda = K + 8, num_k_tiles = K / kBlockK;
    T *sx = reinterpret_cast<T *>(smem);
    T *sw = sx + BM * lda;
    float *sgamma = reinterpret_cast<float *>(sw + STAGES * BN * kLdw);
    float *sbeta = sgamma + K;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int valid_rows = min(BM, a.rows - m0);
    const T *x = static_cast<const T *>(a.x);
    const T *w = static_cast<const T *>(a.weight);

    /* slab: thread t copies chunk t % 8 + 8 i of rows t / 8 + 16 j (rows >= M zero-filled) */
    for (int r = tid / 8; r < BM; r += kThreads / 8) {
        const bool is_valid = r < valid_rows;
        const T *src = x + (int64_t)(m0 + (is_valid ? r : 0)) * a.x_stride;
        for (int c = tid % 8; c < K / 8; c += 8)
            cp_async16(smem_addr(sx + r * lda + c * 8), src + c * 8, is_valid);
    }
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < num_k_tiles)
            fused_ln_gemm_load_w<T, BN>(sw + s * BN * kLdw, w, n0, a.cols, K, s * kBlockK, tid);
        cp_async_commit();
    }
    if (a.has_ln) {
        const T *gamma = static_cast<const T *>(a.gamma);
        const T *beta = static_cast<const T *>(a.beta);
        for (int c = tid; c < K; c += kThreads) {
            sgamma[c] = gamma != nullptr ? elem<T>::to_float(gamma[c]) : 1.0f;
            sbeta[c] = beta != nullptr ? elem<T>::to_float(beta[c]) : 0.0f;
        }
    }
    cp_async_wait<STAGES - 1>(); /* the slab has landed; W tiles may still be in flight */
    __syncthreads();
    if (a.has_ln) {
        /* chunks a lane: the loops are unrolled, so K picks the instance (K <= 1024) */
        if (K <= 384)
            fused_ln_gemm_normalize<T, 3>(sx, lda, sgamma, sbeta, K, valid_rows, a.eps, warp, lane);
        else if (K <= 512)
            fused_ln_gemm_normalize<T, 4>(sx, lda, sgamma, sbeta, K, valid_rows, a.eps, warp, lane);
        else if (K <= 768)
            fused_ln_gemm_normalize<T, 6>(sx, lda, sgamma, sbeta, K, valid_rows, a.eps, warp, lane);
        else
            fused_ln_gemm_normalize<T, 8>(sx, lda, sgamma, sbeta, K, valid_rows, a.eps, warp, lane);
        __syncthreads();
    }

    const int wm = warp / kWarpsN, wn = warp % kWarpsN;
    float acc[kMt][kNt][4];
#pragma unroll
    for (int i = 0; i < kMt; i++)
#pragma unroll
        for (int j = 0; j < kNt; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    /* ldmatrix lane addresses. A (x4): lanes 0-15 rows 0-15 at k, lanes 16-31 rows 0-15 at
     * k + 8 -> a0..a3. B (x4, W rows are n): lanes 0-7 n 0-7 at k, 8-15 n 0-7 at k + 8,
     * 16-23 n 8-15 at k, 24-31 n 8-15 at k + 8 -> b0, b1 of n8 tile 2j, then of 2j + 1. */
    const T *a_lane = sx + (wm * kWm + lane % 16) * lda + (lane / 16) * 8;
    const int b_lane = (wn * kWn + lane % 8 + (lane / 16) * 8) * kLdw + ((lane / 8) % 2) * 8;
    for (int kt = 0; kt < num_k_tiles; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads(); /* tile kt visible; stage (kt - 1) % STAGES free for every warp */
        const int next = kt + STAGES - 1;
        if (next < num_k_tiles)
            fused_ln_gemm_load_w<T, BN>(sw + (next % STAGES) * BN * kLdw, w, n0, a.cols, K,
                                        next * kBlockK, tid);
        cp_async_commit();
        const T *stage = sw + (kt % STAGES) * BN * kLdw;
#pragma unroll
        for (int ks = 0; ks < kBlockK / 16; ks++) {
            uint32_t af[kMt][4], bf[kNt][2];
#pragma unroll
            for (int i = 0; i < kMt; i++)
                ldmatrix_x4(af[i], smem_addr(a_lane + i * 16 * lda + kt * kBlockK + ks * 16));
#pragma unroll
            for (int j = 0; j < kNt / 2; j++) {
                uint32_t r[4];
                ldmatrix_x4(r, smem_addr(stage + b_lane + j * 16 * kLdw + ks * 16));
                bf[2 * j][0] = r[0];
                bf[2 * j][1] = r[1];
                bf[2 * j + 1][0] = r[2];
                bf[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < kMt; i++)
#pragma unroll
                for (int j = 0; j < kNt; j++)
                    elem<T>::mma(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }

    /* epilogue: c0, c1 at (row g, cols 2t, 2t + 1), c2, c3 at row g + 8 */
    const T *bias = static_cast<const T *>(a.bias);
    T *out = static_cast<T *>(a.out);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < kNt; j++) {
        const int col = n0 + wn * kWn + j * 8 + 2 * t;
        if (col >= a.cols)
            continue;
        const float2 bv = bias != nullptr
                              ? elem<T>::unpack(*reinterpret_cast<const uint32_t *>(bias + col))
                              : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int i = 0; i < kMt; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + wm * kWm + i * 16 + g + 8 * h;
                if (row >= a.rows)
                    continue;
                uint32_t y = elem<T>::pack(acc[i][j][2 * h] + bv.x, acc[i][j][2 * h + 1] + bv.y);
                if (a.has_gelu) {
                    const float2 yf = elem<T>::unpack(y);
                    y = elem<T>::pack(gelu_exact(yf.x), gelu_exact(yf.y));
                }
                *reinterpret_cast<uint32_t *>(out + (int64_t)row * a.out_stride + col) = y;
            }
    }
}

/* Baseline LayerNorm (like csrc/kernels/layer_norm.cu's vector path): a warp a row, lane l
 * holds 16-byte chunks l, l + 32, ... (K % 8 == 0, K <= 256 * kChunks), float32 two-pass
 * statistics in registers, rounded once on store. grid = ceil(M / 4). */
template <typename T, int kChunks>
static __global__ void __launch_bounds__(kThreads)
    layer_norm_rows_kernel(T *out, const T *x, const T *gamma, const T *beta, int rows, int K,
                           int64_t x_stride, int64_t out_stride, float eps) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarps + threadIdx.x / 32;
    if (row >= rows)
        return;
    const int num_chunks = K / 8;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + (int64_t)row * x_stride);
    float v[kChunks][8];
    uint4 gc[kChunks], bc[kChunks];
    float mean = 0.0f, var = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunks; i++) {
        const int c = lane + 32 * i;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (c < num_chunks) {
            u = xr[c];
            gc[i] = reinterpret_cast<const uint4 *>(gamma)[c];
            bc[i] = reinterpret_cast<const uint4 *>(beta)[c];
        }
        const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = elem<T>::unpack(words[j]);
            v[i][2 * j] = f.x;
            v[i][2 * j + 1] = f.y;
            mean += f.x + f.y;
        }
    }
    mean = warp_sum(mean) / (float)K;
#pragma unroll
    for (int i = 0; i < kChunks; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            v[i][j] = lane + 32 * i < num_chunks ? v[i][j] - mean : 0.0f;
            var += v[i][j] * v[i][j];
        }
    const float rstd = rsqrtf(warp_sum(var) / (float)K + eps);
    uint4 *orow = reinterpret_cast<uint4 *>(out + (int64_t)row * out_stride);
#pragma unroll
    for (int i = 0; i < kChunks; i++) {
        const int c = lane + 32 * i;
        if (c >= num_chunks)
            continue;
        const uint32_t gw[4] = {gc[i].x, gc[i].y, gc[i].z, gc[i].w};
        const uint32_t bw[4] = {bc[i].x, bc[i].y, bc[i].z, bc[i].w};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 gf = elem<T>::unpack(gw[j]), bf = elem<T>::unpack(bw[j]);
            o[j] = elem<T>::pack(fmaf(v[i][2 * j] * rstd, gf.x, bf.x),
                                 fmaf(v[i][2 * j + 1] * rstd, gf.y, bf.y));
        }
        orow[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

/* Baseline exact GELU, in place on a dense buffer of num_chunks 8-element chunks
 * (like csrc/kernels/gelu.cu's flat vector path); grid-stride. */
template <typename T>
static __global__ void __launch_bounds__(256) gelu_rows_kernel(T *y, int64_t num_chunks) {
    uint4 *p = reinterpret_cast<uint4 *>(y);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < num_chunks;
         i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 u = p[i];
        uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = elem<T>::unpack(words[j]);
            words[j] = elem<T>::pack(gelu_exact(f.x), gelu_exact(f.y));
        }
        p[i] = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// ---- launchers ----

#define CHECK_CUDA(x)                                                                        \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, \
                    __LINE__);                                                               \
            exit(2);                                                                         \
        }                                                                                    \
    } while (0)

#define CHECK_BLAS(x)                                                                       \
    do {                                                                                    \
        cublasStatus_t st_ = (x);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                 \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cublasLtGetStatusString(st_),    \
                    __FILE__, __LINE__);                                                    \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

using fused_kernel_fn = void (*)(fused_ln_gemm_args);

struct fused_config {
    const char *name; /* BMxBNxSTAGES */
    int bm, bn, stages;
    fused_kernel_fn kernel[2]; /* [DTYPE_F16], [DTYPE_BF16] */
};

#define FUSED_CONFIG(BM, BN, S)                                                       \
    {#BM "x" #BN "x" #S, BM, BN, S,                                                   \
     {fused_ln_gemm_kernel<__half, BM, BN, S>, fused_ln_gemm_kernel<__nv_bfloat16, BM, BN, S>}}

static const fused_config kConfigs[] = {
    FUSED_CONFIG(16, 64, 3),  FUSED_CONFIG(16, 128, 3), FUSED_CONFIG(32, 64, 2),
    FUSED_CONFIG(32, 64, 3),  FUSED_CONFIG(32, 128, 2), FUSED_CONFIG(32, 128, 3),
    FUSED_CONFIG(64, 64, 2),  FUSED_CONFIG(64, 64, 3),  FUSED_CONFIG(64, 128, 2),
    FUSED_CONFIG(64, 128, 3),
};
static constexpr int kNumConfigs = (int)(sizeof kConfigs / sizeof kConfigs[0]);

static int g_smem_optin = 0; /* cudaDevAttrMaxSharedMemoryPerBlockOptin */

static size_t fused_ln_gemm_smem_bytes(const fused_config &c, int K, bool has_ln) {
    return (size_t)c.bm * (K + 8) * 2 + (size_t)c.stages * c.bn * kLdw * 2 +
           (has_ln ? (size_t)2 * K * sizeof(float) : 0);
}

/* The probe's domain, asserted before every launch; NULL when a is supported. */
static const char *fused_ln_gemm_unsupported(const fused_ln_gemm_args &a) {
    if (a.rows < 1)
        return "M must be >= 1";
    if (a.inner < kBlockK || a.inner > kMaxInner || a.inner % kBlockK != 0)
        return "K must be a multiple of 64 in [64, 1024]";
    if (a.cols < 64 || a.cols % 64 != 0)
        return "N must be a positive multiple of 64";
    if (a.x_stride < a.inner || a.x_stride % 8 != 0)
        return "x_stride must be >= K and a multiple of 8";
    if (a.out_stride < a.cols || a.out_stride % 2 != 0)
        return "out_stride must be >= N and even";
    if ((uintptr_t)a.x % 16 != 0 || (uintptr_t)a.weight % 16 != 0 || (uintptr_t)a.out % 4 != 0 ||
        (uintptr_t)a.bias % 4 != 0)
        return "x and weight must be 16-byte aligned, out and bias 4-byte aligned";
    return nullptr;
}

/* false when the configuration's shared memory exceeds the device's opt-in limit at this K. */
static bool fused_ln_gemm_fits(const fused_config &c, int K, bool has_ln) {
    return fused_ln_gemm_smem_bytes(c, K, has_ln) <= (size_t)g_smem_optin;
}

static void fused_ln_gemm_launch(const fused_config &c, int dtype, const fused_ln_gemm_args &a,
                                 cudaStream_t stream) {
    const char *why = fused_ln_gemm_unsupported(a);
    if (why != nullptr) {
        fprintf(stderr, "fused_ln_gemm: %s (M=%d N=%d K=%d)\n", why, a.rows, a.cols, a.inner);
        exit(2);
    }
    const dim3 grid((unsigned)((a.cols + c.bn - 1) / c.bn), (unsigned)((a.rows + c.bm - 1) / c.bm));
    c.kernel[dtype]<<<grid, kThreads, fused_ln_gemm_smem_bytes(c, a.inner, a.has_ln != 0),
                      stream>>>(a);
    CHECK_CUDA(cudaGetLastError());
}

/* Once per kernel: opt in to the shared memory its largest supported K needs (capped at the
 * device limit; fused_ln_gemm_fits skips what still does not fit). */
static void fused_ln_gemm_init() {
    int dev = 0;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaDeviceGetAttribute(&g_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    for (const fused_config &c : kConfigs) {
        const size_t need = std::min(fused_ln_gemm_smem_bytes(c, kMaxInner, true),
                                     (size_t)g_smem_optin);
        for (int d = 0; d < 2; d++)
            CHECK_CUDA(cudaFuncSetAttribute(
                c.kernel[d], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
    }
}

/* fp16 LayerNorm of dense rows: out (M, K) from x (M, K), gamma and beta (K,). */
static void layer_norm_rows_launch(void *out, const void *x, const void *gamma, const void *beta,
                                   int rows, int K, float eps, cudaStream_t stream) {
    const dim3 grid((unsigned)((rows + kWarps - 1) / kWarps));
    __half *o = static_cast<__half *>(out);
    const __half *xi = static_cast<const __half *>(x), *g = static_cast<const __half *>(gamma);
    const __half *b = static_cast<const __half *>(beta);
    if ((K / 8 + 31) / 32 <= 2)
        layer_norm_rows_kernel<__half, 2><<<grid, kThreads, 0, stream>>>(o, xi, g, b, rows, K, K, K,
                                                                          eps);
    else
        layer_norm_rows_kernel<__half, 4><<<grid, kThreads, 0, stream>>>(o, xi, g, b, rows, K, K, K,
                                                                          eps);
    CHECK_CUDA(cudaGetLastError());
}

/* fp16 GELU in place on a dense buffer of elems (a multiple of 8) elements. */
static void gelu_rows_launch(void *y, int64_t elems, int sm_count, cudaStream_t stream) {
    const int64_t chunks = elems / 8;
    const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, (int64_t)sm_count * 16);
    gelu_rows_kernel<__half><<<(unsigned)blocks, 256, 0, stream>>>(static_cast<__half *>(y),
                                                                    chunks);
    CHECK_CUDA(cudaGetLastError());
}

/* out (M, N) = x (M, K) . W^T + bias through cuBLASLt the way csrc/kernels/linear.cu calls it:
 * column-major D (N, M) = op(A = W, T) . B (= x), BIAS epilogue, fp32 compute, the heuristic's
 * first algorithm under a 32 MiB workspace. */
struct blas_gemm {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

static constexpr size_t kBlasWorkspaceBytes = (size_t)32 << 20;

static void blas_gemm_init(blas_gemm *g, cublasLtHandle_t handle, int M, int N, int K,
                           const void *bias) {
    const cudaDataType_t type = CUDA_R_16F;
    CHECK_BLAS(cublasLtMatmulDescCreate(&g->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CHECK_BLAS(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                              sizeof trans_a));
    CHECK_BLAS(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                              sizeof trans_b));
    CHECK_BLAS(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                              sizeof epilogue));
    CHECK_BLAS(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                              sizeof bias));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&g->a, type, (uint64_t)K, (uint64_t)N, K));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&g->b, type, (uint64_t)K, (uint64_t)M, K));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&g->d, type, (uint64_t)N, (uint64_t)M, N));
    cublasLtMatmulPreference_t pref;
    CHECK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kBlasWorkspaceBytes;
    CHECK_BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    memset(&result, 0, sizeof result);
    CHECK_BLAS(cublasLtMatmulAlgoGetHeuristic(handle, g->desc, g->a, g->b, g->d, g->d, pref, 1,
                                              &result, &found));
    CHECK_BLAS(cublasLtMatmulPreferenceDestroy(pref));
    if (found < 1) {
        fprintf(stderr, "cuBLASLt: no algorithm for M=%d N=%d K=%d\n", M, N, K);
        exit(2);
    }
    g->algo = result.algo;
}

static void blas_gemm_run(const blas_gemm *g, cublasLtHandle_t handle, void *out, const void *x,
                          const void *w, void *workspace, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    CHECK_BLAS(cublasLtMatmul(handle, g->desc, &alpha, w, g->a, x, g->b, &beta, out, g->d, out,
                              g->d, &g->algo, workspace, kBlasWorkspaceBytes, stream));
}

static void blas_gemm_destroy(blas_gemm *g) {
    cublasLtMatrixLayoutDestroy(g->a);
    cublasLtMatrixLayoutDestroy(g->b);
    cublasLtMatrixLayoutDestroy(g->d);
    cublasLtMatmulDescDestroy(g->desc);
}

// ---- host: inputs, reference, comparison ----

static constexpr uint16_t kPoison = 0xFFFFu; /* NaN in fp16 and in bf16 */
static constexpr float kEps = 1e-6f;         /* timm ViT / DeiT LayerNorm */

static uint16_t to_bits(float v, int dtype) {
    if (dtype == DTYPE_F16) {
        const __half_raw r = __float2half_rn(v);
        return r.x;
    }
    const __nv_bfloat16_raw r = __float2bfloat16_rn(v);
    return r.x;
}

static double from_bits(uint16_t u, int dtype) {
    if (dtype == DTYPE_F16) {
        __half_raw r;
        r.x = u;
        return (double)__half2float(__half(r));
    }
    __nv_bfloat16_raw r;
    r.x = u;
    return (double)__bfloat162float(__nv_bfloat16(r));
}

/* round_to_T of a float64 value (through float: the double rounding is far below tolerance) */
static double round_to(double v, int dtype) { return from_bits(to_bits((float)v, dtype), dtype); }

/* f(i) for i in [0, n) over the host's cores. */
template <typename F>
static void parallel_for(int n, F &&f) {
    const int num_threads =
        std::max(1, std::min<int>(n, std::min(32u, std::thread::hardware_concurrency())));
    std::vector<std::thread> pool;
    for (int t = 0; t < num_threads; t++)
        pool.emplace_back([&, t] {
            for (int i = t; i < n; i += num_threads)
                f(i);
        });
    for (std::thread &th : pool)
        th.join();
}

struct problem {
    int dtype;
    int rows, cols, inner; /* M, N, K */
    int64_t x_stride, out_stride;
    bool has_ln;
    uint64_t seed;
};

/* Host copies (T bits) of one problem's inputs; x has 3 guard rows and its padding (columns
 * >= K, guard rows) is NaN so a stray read shows in the output. */
struct host_inputs {
    std::vector<uint16_t> x, w, bias, gamma, beta;
};

static host_inputs make_inputs(const problem &p) {
    std::mt19937_64 rng(p.seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    const int M = p.rows, N = p.cols, K = p.inner;
    host_inputs in;
    in.x.assign((size_t)(M + 3) * p.x_stride, kPoison);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            in.x[(size_t)m * p.x_stride + k] = to_bits((float)(normal(rng) * 2.0 + 0.5), p.dtype);
    in.w.resize((size_t)N * K);
    for (uint16_t &v : in.w)
        v = to_bits((float)(normal(rng) / std::sqrt((double)K)), p.dtype);
    in.bias.resize(N);
    for (uint16_t &v : in.bias)
        v = to_bits((float)(0.1 * normal(rng)), p.dtype);
    in.gamma.resize(K);
    in.beta.resize(K);
    for (int k = 0; k < K; k++) {
        in.gamma[k] = to_bits((float)(1.0 + 0.1 * normal(rng)), p.dtype);
        in.beta[k] = to_bits((float)(0.1 * normal(rng)), p.dtype);
    }
    return in;
}

/* The unfused pipeline in float64 with its roundings: A = round(LN(x)) (float64 statistics),
 * y = round(A . W^T + bias), gelu = round(0.5 y (1 + erf(y / sqrt 2))). y, gelu: (M, N). */
static void reference(std::vector<double> &y, std::vector<double> &gelu, const host_inputs &in,
                      const problem &p) {
    const int M = p.rows, N = p.cols, K = p.inner, dt = p.dtype;
    std::vector<double> w((size_t)N * K);
    for (size_t i = 0; i < w.size(); i++)
        w[i] = from_bits(in.w[i], dt);
    y.assign((size_t)M * N, 0.0);
    gelu.assign((size_t)M * N, 0.0);
    parallel_for(M, [&](int m) {
        std::vector<double> a(K);
        for (int k = 0; k < K; k++)
            a[k] = from_bits(in.x[(size_t)m * p.x_stride + k], dt);
        if (p.has_ln) {
            double mean = 0.0, var = 0.0;
            for (int k = 0; k < K; k++)
                mean += a[k];
            mean /= K;
            for (int k = 0; k < K; k++)
                var += (a[k] - mean) * (a[k] - mean);
            const double rstd = 1.0 / std::sqrt(var / K + (double)kEps);
            for (int k = 0; k < K; k++)
                a[k] = round_to((a[k] - mean) * rstd * from_bits(in.gamma[k], dt) +
                                    from_bits(in.beta[k], dt),
                                dt);
        }
        for (int n = 0; n < N; n++) {
            const double *wr = &w[(size_t)n * K];
            double s[4] = {0.0, 0.0, 0.0, 0.0};
            for (int k = 0; k < K; k += 4)
                for (int j = 0; j < 4; j++)
                    s[j] += a[k + j] * wr[k + j];
            const double dot = (s[0] + s[1]) + (s[2] + s[3]);
            const double v = round_to(dot + from_bits(in.bias[n], dt), dt);
            y[(size_t)m * N + n] = v;
            gelu[(size_t)m * N + n] = round_to(0.5 * v * (1.0 + std::erf(v * M_SQRT1_2)), dt);
        }
    });
}

/* Per-dtype tolerance: |got - ref| <= kAtol * max|ref| + kRtol * |ref|. The fused and the
 * reference pipeline round at the same three points, so what remains is (1) y landing on the
 * other side of a rounding boundary (1 ulp: <= 2^-10 |y| fp16, 2^-7 bf16), carried through
 * GELU (slope <= 1.13) plus GELU's own rounding: ~2.2 ulp -> kRtol = 4 ulp; and (2) an element
 * of A rounding the other way (float32 vs float64 statistics), each moving y by 1 ulp of A
 * times one weight (~1e-3 of a typical |y| for fp16, 8x for bf16) -> kAtol. A wrong index,
 * a missing K tile, bias or GELU costs far more than both. */
static const double kRtol[2] = {4.0 / 1024.0, 4.0 / 128.0};
static const double kAtol[2] = {1e-3, 8e-3};

struct compare_result {
    bool is_pass;
    double worst; /* max over elements of err / tol (<= 1 passes) */
    std::string detail;
};

/* got: (M + 3) rows of out_stride T bits. Valid elements must be finite and within tolerance;
 * every other element (columns >= N, the 3 guard rows) must still be the poison. */
static compare_result compare(const std::vector<uint16_t> &got, const std::vector<double> &ref,
                              const problem &p) {
    const int M = p.rows, N = p.cols, dt = p.dtype;
    double max_ref = 0.0;
    for (double v : ref)
        max_ref = std::max(max_ref, std::fabs(v));
    compare_result r = {true, 0.0, ""};
    char buf[256];
    for (int m = 0; m < M + 3; m++)
        for (int64_t n = 0; n < p.out_stride; n++) {
            const uint16_t u = got[(size_t)m * p.out_stride + n];
            if (m >= M || n >= N) {
                if (u != kPoison && r.is_pass) {
                    snprintf(buf, sizeof buf, "padding (m=%d, n=%lld) overwritten with 0x%04x", m,
                             (long long)n, u);
                    r = {false, INFINITY, buf};
                }
                continue;
            }
            const double want = ref[(size_t)m * N + n], v = from_bits(u, dt);
            const double tol = kAtol[dt] * max_ref + kRtol[dt] * std::fabs(want);
            const double err = std::fabs(v - want);
            const double ratio = std::isfinite(v) ? err / tol : INFINITY;
            if (!(ratio <= 1.0) && r.is_pass) {
                snprintf(buf, sizeof buf, "(m=%d, n=%lld) got %.6g want %.6g (tol %.3g)", m,
                         (long long)n, v, want, tol);
                r.is_pass = false;
                r.detail = buf;
            }
            r.worst = std::max(r.worst, ratio);
        }
    return r;
}

template <typename V>
static void *to_device(const std::vector<V> &h) {
    void *d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(V)));
    CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice));
    return d;
}

// ---- host: correctness ----

/* Every configuration on every (dtype, K, N, M, LN, GELU) case; returns the failing cases.
 * is_quick: M in {1, 99}, (K, N) in {(384, 384), (448, 320)} (for compute-sanitizer). */
static int run_check(bool is_quick) {
    const int kRows[] = {1, 5, 99, 197, 394, 788};
    const int kShapes[][2] = {{384, 384},  {448, 320},  {384, 1152}, {384, 1536},
                              {768, 2304}, {768, 3072}, {1024, 192}}; /* (K, N) */
    printf("check: %d configurations vs float64 reference (tolerance atol*max|ref| + "
           "rtol*|ref|: f16 %.0e/%.2g, bf16 %.0e/%.2g)\n",
           kNumConfigs, kAtol[0], kRtol[0], kAtol[1], kRtol[1]);
    int failures = 0, case_id = 0;
    for (int dt = 0; dt < 2; dt++)
        for (const auto &shape : kShapes)
            for (int M : kRows)
                for (int has_ln = 0; has_ln < 2; has_ln++, case_id++) {
                    if (is_quick && ((M != 1 && M != 99) || shape[0] * shape[1] > 384 * 384))
                        continue;
                    problem p;
                    p.dtype = dt;
                    p.rows = M;
                    p.inner = shape[0];
                    p.cols = shape[1];
                    /* dense and padded rows, each with and without LN */
                    p.x_stride = p.inner + (case_id / 2 + has_ln) % 2 * 8;
                    p.out_stride = p.cols + case_id / 4 % 2 * 16;
                    p.has_ln = has_ln != 0;
                    p.seed = 0x5eed0000u + (uint64_t)case_id;
                    const host_inputs in = make_inputs(p);
                    std::vector<double> ref_y, ref_gelu;
                    reference(ref_y, ref_gelu, in, p);
                    void *x = to_device(in.x), *w = to_device(in.w), *bias = to_device(in.bias);
                    void *gamma = to_device(in.gamma), *beta = to_device(in.beta);
                    const size_t out_elems = (size_t)(M + 3) * p.out_stride;
                    void *out = nullptr;
                    CHECK_CUDA(cudaMalloc(&out, out_elems * 2));
                    std::vector<uint16_t> got(out_elems);
                    for (int has_gelu = 0; has_gelu < 2; has_gelu++) {
                        fused_ln_gemm_args a;
                        a.out = out;
                        a.x = x;
                        a.weight = w;
                        a.bias = bias;
                        a.gamma = gamma;
                        a.beta = beta;
                        a.rows = M;
                        a.cols = p.cols;
                        a.inner = p.inner;
                        a.x_stride = p.x_stride;
                        a.out_stride = p.out_stride;
                        a.eps = kEps;
                        a.has_ln = has_ln;
                        a.has_gelu = has_gelu;
                        double worst = 0.0;
                        int ran = 0;
                        std::string failed, skipped;
                        for (const fused_config &c : kConfigs) {
                            if (!fused_ln_gemm_fits(c, p.inner, p.has_ln)) {
                                skipped += std::string(" ") + c.name;
                                continue;
                            }
                            CHECK_CUDA(cudaMemset(out, 0xFF, out_elems * 2)); /* NaN poison */
                            fused_ln_gemm_launch(c, dt, a, 0);
                            CHECK_CUDA(cudaDeviceSynchronize());
                            CHECK_CUDA(cudaMemcpy(got.data(), out, out_elems * 2,
                                                  cudaMemcpyDeviceToHost));
                            const compare_result r = compare(got, has_gelu ? ref_gelu : ref_y, p);
                            worst = std::max(worst, r.worst);
                            ran++;
                            if (!r.is_pass)
                                failed += std::string("\n    ") + c.name + ": " + r.detail;
                        }
                        const bool is_pass = failed.empty() && ran > 0;
                        failures += is_pass ? 0 : 1;
                        printf("%s %-4s ln=%d gelu=%d M=%-3d K=%-4d N=%-4d x_stride=%-4lld "
                               "out_stride=%-4lld seed=%#llx err/tol=%.3f (%d configs%s%s)%s\n",
                               is_pass ? "PASS" : "FAIL", kDtypeNames[dt], has_ln, has_gelu, M,
                               p.inner, p.cols, (long long)p.x_stride, (long long)p.out_stride,
                               (unsigned long long)p.seed, worst, ran,
                               skipped.empty() ? "" : "; skipped, shared memory:", skipped.c_str(),
                               failed.c_str());
                    }
                    for (void *ptr : {x, w, bias, gamma, beta, out})
                        CHECK_CUDA(cudaFree(ptr));
                }
    return failures;
}

// ---- host: bench ----

static constexpr int kCallsPerGraph = 20;
static constexpr int kReplays = 50;
static constexpr int kSamples = 5;

/* Median over kSamples of (kReplays replays of a graph of enqueue(0 .. kCallsPerGraph-1)),
 * in microseconds per call. */
template <typename F>
static double time_graph_us(cudaStream_t stream, F &&enqueue) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kCallsPerGraph; i++)
        enqueue(i);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 5; i++) /* warm-up */
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<double> samples;
    for (int s = 0; s < kSamples; s++) {
        CHECK_CUDA(cudaEventRecord(e0, stream));
        for (int r = 0; r < kReplays; r++)
            CHECK_CUDA(cudaGraphLaunch(exec, stream));
        CHECK_CUDA(cudaEventRecord(e1, stream));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        samples.push_back(1e3 * ms / (kReplays * kCallsPerGraph));
    }
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
}

/* A random fp16 device buffer of n elements, value ~ mean + scale * N(0, 1). */
static void *random_device_f16(size_t n, double mean, double scale, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<uint16_t> h(n);
    for (uint16_t &v : h)
        v = to_bits((float)(mean + scale * normal(rng)), DTYPE_F16);
    return to_device(h);
}

/* max over elements of |got - want| / tolerance (fp16, twice the check's: both are GPU results) */
static double bench_diff(const void *got_d, const void *want_d, size_t n) {
    std::vector<uint16_t> got(n), want(n);
    CHECK_CUDA(cudaMemcpy(got.data(), got_d, n * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want.data(), want_d, n * 2, cudaMemcpyDeviceToHost));
    double max_ref = 0.0, worst = 0.0;
    for (uint16_t u : want)
        max_ref = std::max(max_ref, std::fabs(from_bits(u, DTYPE_F16)));
    for (size_t i = 0; i < n; i++) {
        const double v = from_bits(got[i], DTYPE_F16), r = from_bits(want[i], DTYPE_F16);
        const double tol = 2.0 * (kAtol[DTYPE_F16] * max_ref + kRtol[DTYPE_F16] * std::fabs(r));
        worst = std::max(worst, std::isfinite(v) ? std::fabs(v - r) / tol : INFINITY);
    }
    return worst;
}

struct bench_op {
    std::string label; /* "deit-s qkv" */
    int M, K, N;
    bool has_gelu;
    double fused[kNumConfigs], core[kNumConfigs]; /* us; < 0: configuration skipped */
    double baseline, blas, ln, gelu;
    double check; /* fused vs baseline, err / tol */
};

static int best_config(const double *t) {
    int best = -1;
    for (int i = 0; i < kNumConfigs; i++)
        if (t[i] >= 0.0 && (best < 0 || t[i] < t[best]))
            best = i;
    return best;
}

/* DeiT-S (C 384, qkv 1152, fc1 1536) and DeiT-B (C 768, qkv 2304, fc1 3072), fp16:
 * fused LN+qkv and LN+fc1+GELU (every configuration) vs LN kernel + cuBLASLt (BIAS)
 * [+ GELU kernel]; cuBLASLt alone and the fused kernel without LN ("core") for reference. */
static void run_bench(bool is_cold, int sm_count) {
    struct model {
        const char *name;
        int C, qkv, hidden;
    };
    const model kModels[] = {{"deit-s", 384, 1152, 1536}, {"deit-b", 768, 2304, 3072}};
    const int kRows[] = {99, 197, 394, 788};
    const int num_copies = is_cold ? kCallsPerGraph : 1;
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasLtHandle_t handle;
    CHECK_BLAS(cublasLtCreate(&handle));
    void *workspace = nullptr;
    CHECK_CUDA(cudaMalloc(&workspace, kBlasWorkspaceBytes));
    std::vector<bench_op> ops;
    uint64_t seed = 0xbe7c4000u;
    for (const model &md : kModels)
        for (int M : kRows) {
            const int C = md.C;
            void *x = random_device_f16((size_t)M * C, 0.5, 2.0, seed++);
            void *gamma = random_device_f16(C, 1.0, 0.1, seed++);
            void *beta = random_device_f16(C, 0.0, 0.1, seed++);
            void *xn = nullptr;
            CHECK_CUDA(cudaMalloc(&xn, (size_t)M * C * 2));
            for (int is_fc1 = 0; is_fc1 < 2; is_fc1++) {
                const int N = is_fc1 ? md.hidden : md.qkv;
                bench_op op;
                op.label = std::string(md.name) + (is_fc1 ? " fc1" : " qkv");
                op.M = M;
                op.K = C;
                op.N = N;
                op.has_gelu = is_fc1 != 0;
                std::vector<void *> w(num_copies); /* the same values in every copy */
                w[0] = random_device_f16((size_t)N * C, 0.0, 1.0 / std::sqrt((double)C), seed++);
                for (int i = 1; i < num_copies; i++) {
                    CHECK_CUDA(cudaMalloc(&w[i], (size_t)N * C * 2));
                    CHECK_CUDA(cudaMemcpy(w[i], w[0], (size_t)N * C * 2, cudaMemcpyDeviceToDevice));
                }
                void *bias = random_device_f16(N, 0.0, 0.1, seed++);
                void *out = nullptr, *out_ref = nullptr;
                CHECK_CUDA(cudaMalloc(&out, (size_t)M * N * 2));
                CHECK_CUDA(cudaMalloc(&out_ref, (size_t)M * N * 2));
                blas_gemm plan;
                blas_gemm_init(&plan, handle, M, N, C, bias);
                fused_ln_gemm_args a;
                a.out = out;
                a.x = x;
                a.weight = w[0];
                a.bias = bias;
                a.gamma = gamma;
                a.beta = beta;
                a.rows = M;
                a.cols = N;
                a.inner = C;
                a.x_stride = C;
                a.out_stride = N;
                a.eps = kEps;
                a.has_ln = 1;
                a.has_gelu = op.has_gelu;
                auto baseline = [&](int i, void *dst) {
                    layer_norm_rows_launch(xn, x, gamma, beta, M, C, kEps, stream);
                    blas_gemm_run(&plan, handle, dst, xn, w[i % num_copies], workspace, stream);
                    if (op.has_gelu)
                        gelu_rows_launch(dst, (int64_t)M * N, sm_count, stream);
                };
                /* correctness first: the baseline pipeline against the (checked) fused kernel */
                int first = 0;
                while (first < kNumConfigs && !fused_ln_gemm_fits(kConfigs[first], C, true))
                    first++;
                if (first == kNumConfigs) {
                    fprintf(stderr, "bench: no configuration fits in shared memory at K=%d\n", C);
                    exit(2);
                }
                baseline(0, out_ref);
                fused_ln_gemm_launch(kConfigs[first], DTYPE_F16, a, stream);
                CHECK_CUDA(cudaStreamSynchronize(stream));
                op.check = bench_diff(out, out_ref, (size_t)M * N);
                if (!(op.check <= 1.0)) {
                    fprintf(stderr, "bench: %s M=%d: baseline and fused kernel disagree "
                            "(err/tol %.3g)\n", op.label.c_str(), M, op.check);
                    exit(1);
                }
                for (int ci = 0; ci < kNumConfigs; ci++) {
                    const fused_config &c = kConfigs[ci];
                    op.fused[ci] = op.core[ci] = -1.0;
                    if (!fused_ln_gemm_fits(c, C, true))
                        continue;
                    op.fused[ci] = time_graph_us(stream, [&](int i) {
                        fused_ln_gemm_args ai = a;
                        ai.weight = w[i % num_copies];
                        fused_ln_gemm_launch(c, DTYPE_F16, ai, stream);
                    });
                    op.core[ci] = time_graph_us(stream, [&](int i) {
                        fused_ln_gemm_args ai = a;
                        ai.weight = w[i % num_copies];
                        ai.has_ln = 0;
                        ai.has_gelu = 0;
                        fused_ln_gemm_launch(c, DTYPE_F16, ai, stream);
                    });
                }
                op.baseline = time_graph_us(stream, [&](int i) { baseline(i, out_ref); });
                op.blas = time_graph_us(stream, [&](int i) {
                    blas_gemm_run(&plan, handle, out_ref, xn, w[i % num_copies], workspace, stream);
                });
                op.ln = time_graph_us(stream, [&](int) {
                    layer_norm_rows_launch(xn, x, gamma, beta, M, C, kEps, stream);
                });
                op.gelu = !op.has_gelu ? -1.0 : time_graph_us(stream, [&](int) {
                    gelu_rows_launch(out_ref, (int64_t)M * N, sm_count, stream);
                });
                ops.push_back(op);
                blas_gemm_destroy(&plan);
                for (void *ptr : w)
                    CHECK_CUDA(cudaFree(ptr));
                for (void *ptr : {bias, out, out_ref})
                    CHECK_CUDA(cudaFree(ptr));
            }
            for (void *ptr : {x, gamma, beta, xn})
                CHECK_CUDA(cudaFree(ptr));
        }
    CHECK_CUDA(cudaFree(workspace));
    CHECK_BLAS(cublasLtDestroy(handle));
    CHECK_CUDA(cudaStreamDestroy(stream));

    double worst = 0.0;
    for (const bench_op &op : ops)
        worst = std::max(worst, op.check);
    printf("\nbench: baseline (LN kernel + cuBLASLt BIAS [+ GELU kernel]) matches the fused kernel "
           "on every shape (worst err/tol %.3f)\n",
           worst);
    printf("fp16, CUDA graph of %d calls, median of %d x %d replays, us per call; weights %s\n"
           "fused = LN+GEMM+bias[+GELU] in one kernel (best configuration BMxBNxSTAGES), "
           "baseline = LN + cuBLASLt [+ GELU],\nratio = fused / baseline, cublas = cuBLASLt GEMM "
           "alone, core = fused kernel with LN off (GEMM+bias only, vs cublas)\n\n",
           kCallsPerGraph, kSamples, kReplays,
           is_cold ? "cold (a copy per call in the graph)" : "L2-hot (one copy)");
    printf("%-11s %4s %4s %5s | %7s %-9s | %8s %6s | %7s %6s %6s | %7s %-9s\n", "op", "M", "K", "N",
           "fused", "(config)", "baseline", "ratio", "cublas", "LN", "GELU", "core", "(config)");
    for (const bench_op &op : ops) {
        const int bf = best_config(op.fused), bc = best_config(op.core);
        char gelu[16] = "     -";
        if (op.has_gelu)
            snprintf(gelu, sizeof gelu, "%6.2f", op.gelu);
        printf("%-11s %4d %4d %5d | %7.2f %-9s | %8.2f %6.3f | %7.2f %6.2f %6s | %7.2f %-9s\n",
               op.label.c_str(), op.M, op.K, op.N, op.fused[bf], kConfigs[bf].name, op.baseline,
               op.fused[bf] / op.baseline, op.blas, op.ln, gelu, op.core[bc], kConfigs[bc].name);
    }
    for (int is_core = 0; is_core < 2; is_core++) {
        printf("\nper configuration, us per call: %s\n%-11s %4s",
               is_core ? "core (LN off, GELU off)" : "fused (LN on; GELU on for fc1)", "op", "M");
        for (const fused_config &c : kConfigs)
            printf(" %9s", c.name);
        printf("\n");
        for (const bench_op &op : ops) {
            const double *t = is_core ? op.core : op.fused;
            const int best = best_config(t);
            printf("%-11s %4d", op.label.c_str(), op.M);
            for (int ci = 0; ci < kNumConfigs; ci++) {
                if (t[ci] < 0.0)
                    printf(" %9s", "-");
                else
                    printf(" %8.2f%s", t[ci], ci == best ? "*" : " ");
            }
            printf("\n");
        }
    }
}

// ---- main ----

int main(int argc, char **argv) {
    bool is_bench = false, is_cold = false, is_quick = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--check") == 0)
            continue; /* always runs */
        else if (strcmp(argv[i], "--bench") == 0)
            is_bench = true;
        else if (strcmp(argv[i], "--cold") == 0)
            is_cold = true;
        else if (strcmp(argv[i], "--quick") == 0)
            is_quick = true;
        else {
            fprintf(stderr, "usage: %s [--check] [--quick] [--bench [--cold]]\n", argv[0]);
            return 2;
        }
    }
    int dev = 0, sm_count = 0, runtime = 0, driver = 0;
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
    CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
    CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
    CHECK_CUDA(cudaDriverGetVersion(&driver));
    fused_ln_gemm_init();
    printf("device: %s (sm_%d%d, %d SMs, %d KiB opt-in shared memory a block), CUDA runtime %d, "
           "driver %d, cuBLASLt %zu\n",
           prop.name, prop.major, prop.minor, sm_count, g_smem_optin / 1024, runtime, driver,
           cublasLtGetVersion());
    const int failures = run_check(is_quick);
    if (failures > 0) {
        printf("FAIL: %d case(s)\n", failures);
        return 1;
    }
    printf("ALL PASS\n");
    if (is_bench)
        run_bench(is_cold, sm_count);
    return 0;
}
