/* attention_fma.cu — the fp32 FMA path: q, k, v, out (T, H, D) fp16/bf16/fp32 with the head
 * dim contiguous and any token/head strides, D in {32, 64, 80, 96, 128}, optional per-key bias
 * (T,) fp32; every product and sum in fp32 on the FMA pipes (no TF32). grid = (query tiles of
 * 16, H, min(S, 65535)), 4 warps x 4 query rows a block, K/V tiles of 32 keys staged as fp32.
 * cls_attn: grid = (S), 256 threads, a thread per key summing its probabilities over the heads
 * in order (deterministic, no atomics). That kernel lives here because only this path launches
 * it: the mma.sync kernel computes cls_attn in its own grid and wgmma never takes cls_attn.
 * Covered by tests/test_attention.py (fp32, unaligned views, cls_attn, bias). */
#include "attention.cuh"

static constexpr int kFmaWarps = 4;
static constexpr int kFmaRowsPerWarp = 4;
static constexpr int kFmaRows = kFmaWarps * kFmaRowsPerWarp; /* query rows per block */
static constexpr int kFmaKeys = 32;                          /* keys per K/V tile */
static constexpr int kFmaThreads = kFmaWarps * 32;
static constexpr int kClsThreads = 256;
static constexpr int kClsMaxHeads = 4096; /* dynamic shared memory: 8 bytes per head */
static constexpr unsigned kFullMask = 0xffffffffu;

// ---- device helpers ----

static __device__ __forceinline__ float attention_fma_to_float(float x) { return x; }
static __device__ __forceinline__ float attention_fma_to_float(__half x) { return __half2float(x); }
static __device__ __forceinline__ float attention_fma_to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

static __device__ __forceinline__ void attention_fma_store(float *dst, float x) { *dst = x; }
static __device__ __forceinline__ void attention_fma_store(__half *dst, float x) {
    *dst = __float2half_rn(x);
}
static __device__ __forceinline__ void attention_fma_store(__nv_bfloat16 *dst, float x) {
    *dst = __float2bfloat16_rn(x);
}

/* xor butterflies: every lane ends with the bitwise-same value. */
static __device__ __forceinline__ float attention_fma_warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    return x;
}

static __device__ __forceinline__ float attention_fma_warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}

/* Length of sequence s and its first token, or -1 when its cu_seqlens entries
 * must be skipped (the reason is ORed into the error flag when should_flag). */
static __device__ __forceinline__ int attention_fma_seq(const ragvit_attention_args &a, int64_t s,
                                                        bool should_flag, int *start) {
    const int first = a.cu_seqlens[s];
    const int end = a.cu_seqlens[s + 1];
    if (first < 0 || end < first || (int64_t)end > a.total_tokens) {
        if (should_flag && a.error_flag != nullptr)
            atomicOr(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
        return -1;
    }
    if (end - first > a.max_seqlen) {
        if (should_flag && a.error_flag != nullptr)
            atomicOr(a.error_flag, RAGVIT_ERROR_SEQLEN_OVER_MAX);
        return -1;
    }
    *start = first;
    return end - first;
}

/* acc + the dot product of two 16-byte vectors of T. */
static __device__ __forceinline__ float attention_fma_dot16(uint4 x, uint4 y, float acc,
                                                            const float *) {
    acc = fmaf(__uint_as_float(x.x), __uint_as_float(y.x), acc);
    acc = fmaf(__uint_as_float(x.y), __uint_as_float(y.y), acc);
    acc = fmaf(__uint_as_float(x.z), __uint_as_float(y.z), acc);
    return fmaf(__uint_as_float(x.w), __uint_as_float(y.w), acc);
}
static __device__ __forceinline__ float attention_fma_dot16(uint4 x, uint4 y, float acc,
                                                            const __half *) {
    const __half2 *xs = reinterpret_cast<const __half2 *>(&x);
    const __half2 *ys = reinterpret_cast<const __half2 *>(&y);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 xf = __half22float2(xs[i]), yf = __half22float2(ys[i]);
        acc = fmaf(xf.x, yf.x, acc);
        acc = fmaf(xf.y, yf.y, acc);
    }
    return acc;
}
static __device__ __forceinline__ float attention_fma_dot16(uint4 x, uint4 y, float acc,
                                                            const __nv_bfloat16 *) {
    const __nv_bfloat162 *xs = reinterpret_cast<const __nv_bfloat162 *>(&x);
    const __nv_bfloat162 *ys = reinterpret_cast<const __nv_bfloat162 *>(&y);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 xf = __bfloat1622float2(xs[i]), yf = __bfloat1622float2(ys[i]);
        acc = fmaf(xf.x, yf.x, acc);
        acc = fmaf(xf.y, yf.y, acc);
    }
    return acc;
}

/* Base-2 logit of query token `query` against key token `key` in head h (plus the key's
 * bias when has_bias), computed by one thread; bitwise the same on every call with the
 * same arguments. is_vec: rows are 16-byte aligned (D * sizeof(T) is always a multiple
 * of 16). */
template <typename T, bool is_vec, bool has_bias>
static __device__ __forceinline__ float attention_fma_cls_logit(const ragvit_attention_args &a,
                                                                int64_t query, int64_t key,
                                                                int64_t h, float q_scale) {
    const T *qr = static_cast<const T *>(a.q) + query * a.q_stride_token + h * a.q_stride_head;
    const T *kr = static_cast<const T *>(a.k) + key * a.k_stride_token + h * a.k_stride_head;
    float acc = 0.0f;
    if (is_vec) {
        constexpr int kPerVec = 16 / (int)sizeof(T);
        for (int d = 0; d < a.head_dim; d += kPerVec)
            acc = attention_fma_dot16(*reinterpret_cast<const uint4 *>(qr + d),
                                      *reinterpret_cast<const uint4 *>(kr + d), acc, qr);
    } else {
        for (int d = 0; d < a.head_dim; ++d)
            acc = fmaf(attention_fma_to_float(qr[d]), attention_fma_to_float(kr[d]), acc);
    }
    if (has_bias) return fmaf(acc, q_scale, a.bias[key * a.bias_stride] * ATTENTION_LOG2E);
    return acc * q_scale;
}

/* Merges softmax state (m2, l2) into (m, l): l = sum of exp2(x - m). Symmetric in its
 * two operands, bit for bit, so xor-butterfly lanes all end with the same state. */
static __device__ __forceinline__ void attention_fma_merge(float &m, float &l, float m2, float l2) {
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return; /* both empty */
    l = l * exp2f(m - m_new) + l2 * exp2f(m2 - m_new);
    m = m_new;
}

// ---- kernels ----

/* Block (x, y, z) handles query tiles x, x + gridDim.x, ... of heads y, y + gridDim.y, ...
 * of sequences z, z + gridDim.z, ...; every loop bound below is uniform across the block,
 * so each __syncthreads is reached by all of its threads. Online softmax in base 2: q is
 * scaled by scale * log2 e as it is staged, so exp2f replaces expf; with has_bias (a template
 * flag: the kernels without a bias are the code without the feature) key j's logit gains
 * bias[j] * log2 e. */
template <int D, typename T, bool has_bias>
static __global__ void __launch_bounds__(kFmaThreads, 4)
    attention_fma_kernel(const ragvit_attention_args a) {
    cuda_pdl_wait();                      /* first: see cuda_util.cuh */
    constexpr int kSlots = (D + 31) / 32; /* output dims per lane: d = lane + 32 * i */
    static_assert(D % 4 == 0, "q_s rows are read as float4");
    __shared__ __align__(16) float q_s[kFmaRows][D];
    __shared__ float k_s[kFmaKeys][D + 1]; /* +1: lane j reads row j, conflict-free */
    __shared__ float v_s[kFmaKeys][D];

    const T *q = static_cast<const T *>(a.q);
    const T *k = static_cast<const T *>(a.k);
    const T *v = static_cast<const T *>(a.v);
    T *out = static_cast<T *>(a.out);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const float q_scale = a.scale * ATTENTION_LOG2E;

    for (int64_t s = blockIdx.z; s < a.num_seqs; s += gridDim.z) {
        int start = 0;
        const int len =
            attention_fma_seq(a, s, blockIdx.x == 0 && blockIdx.y == 0 && tid == 0, &start);
        for (int64_t tile = blockIdx.x; tile * kFmaRows < len; tile += gridDim.x) {
            const int q0 = (int)(tile * kFmaRows);
            for (int64_t h = blockIdx.y; h < a.num_heads; h += gridDim.y) {
                __syncthreads(); /* the previous tile is done with q_s, k_s, v_s */
                for (int i = tid; i < kFmaRows * D; i += kFmaThreads) {
                    const int r = i / D;
                    const int d = i - r * D;
                    float x = 0.0f;
                    if (q0 + r < len)
                        x = attention_fma_to_float(q[(int64_t)(start + q0 + r) * a.q_stride_token +
                                                     h * a.q_stride_head + d]) *
                            q_scale;
                    q_s[r][d] = x;
                }

                float m[kFmaRowsPerWarp], l[kFmaRowsPerWarp];
                float acc[kFmaRowsPerWarp][kSlots];
#pragma unroll
                for (int r = 0; r < kFmaRowsPerWarp; ++r) {
                    m[r] = -INFINITY;
                    l[r] = 0.0f;
#pragma unroll
                    for (int i = 0; i < kSlots; ++i) acc[r][i] = 0.0f;
                }

                for (int kv0 = 0; kv0 < len; kv0 += kFmaKeys) {
                    __syncthreads(); /* q_s written; the previous K/V tile consumed */
                    for (int i = tid; i < kFmaKeys * D; i += kFmaThreads) {
                        const int j = i / D;
                        const int d = i - j * D;
                        float kx = 0.0f, vx = 0.0f; /* zero padding: p = 0 must not meet NaN */
                        if (kv0 + j < len) {
                            const int64_t t = start + kv0 + j;
                            kx = attention_fma_to_float(
                                k[t * a.k_stride_token + h * a.k_stride_head + d]);
                            vx = attention_fma_to_float(
                                v[t * a.v_stride_token + h * a.v_stride_head + d]);
                        }
                        k_s[j][d] = kx;
                        v_s[j][d] = vx;
                    }
                    __syncthreads();

                    /* Lane j scores key kv0 + j against the warp's rows. */
                    float score[kFmaRowsPerWarp];
#pragma unroll
                    for (int r = 0; r < kFmaRowsPerWarp; ++r) score[r] = 0.0f;
#pragma unroll
                    for (int d = 0; d < D; d += 4) {
                        const float k0 = k_s[lane][d], k1 = k_s[lane][d + 1];
                        const float k2 = k_s[lane][d + 2], k3 = k_s[lane][d + 3];
#pragma unroll
                        for (int r = 0; r < kFmaRowsPerWarp; ++r) {
                            const float4 qv = *reinterpret_cast<const float4 *>(
                                &q_s[warp * kFmaRowsPerWarp + r][d]);
                            score[r] = fmaf(qv.x, k0, score[r]);
                            score[r] = fmaf(qv.y, k1, score[r]);
                            score[r] = fmaf(qv.z, k2, score[r]);
                            score[r] = fmaf(qv.w, k3, score[r]);
                        }
                    }

                    /* Online softmax; key kv0 (lane 0) is always valid, so m_new is finite
                     * (with a bias: when the bias is finite). Keys past len read no bias. */
                    const bool is_key = kv0 + lane < len;
                    float key_bias = 0.0f;
                    if (has_bias && is_key)
                        key_bias =
                            a.bias[(int64_t)(start + kv0 + lane) * a.bias_stride] * ATTENTION_LOG2E;
                    float p[kFmaRowsPerWarp];
#pragma unroll
                    for (int r = 0; r < kFmaRowsPerWarp; ++r) {
                        const float sv =
                            is_key ? (has_bias ? score[r] + key_bias : score[r]) : -INFINITY;
                        const float m_new = fmaxf(m[r], attention_fma_warp_max(sv));
                        const float alpha = exp2f(m[r] - m_new);
                        p[r] = exp2f(sv - m_new);
                        l[r] = l[r] * alpha + attention_fma_warp_sum(p[r]);
                        m[r] = m_new;
#pragma unroll
                        for (int i = 0; i < kSlots; ++i) acc[r][i] *= alpha;
                    }

                    const int num_keys = min(kFmaKeys, len - kv0);
                    for (int j = 0; j < num_keys; ++j) {
                        float pj[kFmaRowsPerWarp];
#pragma unroll
                        for (int r = 0; r < kFmaRowsPerWarp; ++r)
                            pj[r] = __shfl_sync(kFullMask, p[r], j);
#pragma unroll
                        for (int i = 0; i < kSlots; ++i) {
                            const int d = lane + 32 * i;
                            if (D % 32 == 0 || d < D) {
                                const float vx = v_s[j][d];
#pragma unroll
                                for (int r = 0; r < kFmaRowsPerWarp; ++r)
                                    acc[r][i] = fmaf(pj[r], vx, acc[r][i]);
                            }
                        }
                    }
                }

#pragma unroll
                for (int r = 0; r < kFmaRowsPerWarp; ++r) {
                    const int row = q0 + warp * kFmaRowsPerWarp + r;
                    if (row >= len) continue;
                    const float inv_l = 1.0f / l[r];
                    T *dst =
                        out + (int64_t)(start + row) * a.out_stride_token + h * a.out_stride_head;
#pragma unroll
                    for (int i = 0; i < kSlots; ++i) {
                        const int d = lane + 32 * i;
                        if (D % 32 == 0 || d < D) attention_fma_store(dst + d, acc[r][i] * inv_l);
                    }
                }
            }
        }
    }
}

/* Block x handles sequences x, x + gridDim.x, ...: pass 1 finds each head's softmax
 * max and sum of the first query's logits (a block reduction per head), pass 2 gives
 * thread tid the keys j = tid (mod 256) and sums their probabilities over heads 0..H-1
 * in order, so every cls_attn entry is written once, by one thread, deterministically. */
template <typename T, bool is_vec, bool has_bias>
static __global__ void __launch_bounds__(kClsThreads, 2)
    attention_fma_cls_kernel(const ragvit_attention_args a) {
    cuda_pdl_wait();                 /* first: see cuda_util.cuh */
    extern __shared__ float cls_s[]; /* [H] max, then [H] 1 / sum, per head */
    __shared__ float part_m[kClsThreads / 32], part_l[kClsThreads / 32];
    float *head_m = cls_s;
    float *head_inv_l = cls_s + a.num_heads;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const float q_scale = a.scale * ATTENTION_LOG2E;

    for (int64_t s = blockIdx.x; s < a.num_seqs; s += gridDim.x) {
        int start = 0;
        const int len = attention_fma_seq(a, s, tid == 0, &start);
        if (len <= 0) continue; /* uniform: every thread read the same entries */
        __syncthreads();        /* the previous sequence is done reading head_m, head_inv_l */
        for (int h = 0; h < a.num_heads; ++h) {
            float m = -INFINITY, l = 0.0f;
            for (int j = tid; j < len; j += kClsThreads) {
                const float x =
                    attention_fma_cls_logit<T, is_vec, has_bias>(a, start, start + j, h, q_scale);
                attention_fma_merge(m, l, x, 1.0f);
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                const float m2 = __shfl_xor_sync(kFullMask, m, offset);
                const float l2 = __shfl_xor_sync(kFullMask, l, offset);
                attention_fma_merge(m, l, m2, l2);
            }
            if (lane == 0) {
                part_m[warp] = m;
                part_l[warp] = l;
            }
            __syncthreads();
            if (tid == 0) {
                float m_all = -INFINITY, l_all = 0.0f;
                for (int w = 0; w < kClsThreads / 32; ++w)
                    attention_fma_merge(m_all, l_all, part_m[w], part_l[w]);
                head_m[h] = m_all;
                head_inv_l[h] = 1.0f / l_all;
            }
            __syncthreads(); /* head_* written; part_* free for the next head */
        }

        for (int j = tid; j < len; j += kClsThreads) {
            float sum = 0.0f;
            for (int h = 0; h < a.num_heads; ++h) {
                const float x =
                    attention_fma_cls_logit<T, is_vec, has_bias>(a, start, start + j, h, q_scale);
                sum += exp2f(x - head_m[h]) * head_inv_l[h];
            }
            a.cls_attn[(int64_t)(start + j) * a.cls_attn_stride] = sum / (float)a.num_heads;
        }
    }
}

// ---- launcher ----

template <int D, typename T>
static ragvit_status attention_fma_launch_hdim(const ragvit_attention_args *a,
                                               const ragvit_device_info *dev, cudaStream_t stream) {
    const int64_t heads =
        a->num_heads < ATTENTION_MAX_GRID_YZ ? a->num_heads : ATTENTION_MAX_GRID_YZ;
    const int64_t seqs = a->num_seqs < ATTENTION_MAX_GRID_YZ ? a->num_seqs : ATTENTION_MAX_GRID_YZ;
    const int64_t max_seqlen = a->max_seqlen > 0 ? a->max_seqlen : 1;
    int64_t tiles = (max_seqlen + kFmaRows - 1) / kFmaRows;
    const int64_t sm_count = dev->sm_count > 0 ? dev->sm_count : 1;
    tiles =
        attention_cap_grid_x(tiles, heads, seqs, a->total_tokens, a->num_seqs, kFmaRows, sm_count);
    const dim3 grid((unsigned)tiles, (unsigned)heads, (unsigned)seqs);
    if (a->bias != nullptr)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_kernel<D, T, true>, grid,
                             kFmaThreads, 0, stream, *a));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_kernel<D, T, false>, grid,
                             kFmaThreads, 0, stream, *a));
    return RAGVIT_STATUS_OK;
}

template <typename T>
static ragvit_status attention_fma_cls_launch(const ragvit_attention_args *a,
                                              const ragvit_device_info *dev, cudaStream_t stream) {
    if (a->num_heads > kClsMaxHeads)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "attention: num_heads must be <= %d with cls_attn, got %d", kClsMaxHeads,
                           (int)a->num_heads);
    const int64_t es = (int64_t)sizeof(T);
    const bool is_vec = (uintptr_t)a->q % 16 == 0 && (uintptr_t)a->k % 16 == 0 &&
                        a->q_stride_token * es % 16 == 0 && a->q_stride_head * es % 16 == 0 &&
                        a->k_stride_token * es % 16 == 0 && a->k_stride_head * es % 16 == 0 &&
                        a->head_dim * es % 16 == 0;
    const dim3 grid((unsigned)a->num_seqs);
    const size_t smem = 2 * sizeof(float) * (size_t)a->num_heads;
    const bool has_bias = a->bias != nullptr;
    if (is_vec && has_bias)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_cls_kernel<T, true, true>,
                             grid, kClsThreads, smem, stream, *a));
    else if (is_vec)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_cls_kernel<T, true, false>,
                             grid, kClsThreads, smem, stream, *a));
    else if (has_bias)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_cls_kernel<T, false, true>,
                             grid, kClsThreads, smem, stream, *a));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, attention_fma_cls_kernel<T, false, false>,
                             grid, kClsThreads, smem, stream, *a));
    return RAGVIT_STATUS_OK;
}

/* The attention kernel for a->head_dim, then (with cls_attn) the cls_attn kernel. */
template <typename T>
static ragvit_status attention_fma_launch_dtype(const ragvit_attention_args *a,
                                                const ragvit_device_info *dev,
                                                cudaStream_t stream) {
    switch (a->head_dim) {
    case 32: RAGVIT_TRY((attention_fma_launch_hdim<32, T>(a, dev, stream))); break;
    case 64: RAGVIT_TRY((attention_fma_launch_hdim<64, T>(a, dev, stream))); break;
    case 80: RAGVIT_TRY((attention_fma_launch_hdim<80, T>(a, dev, stream))); break;
    case 96: RAGVIT_TRY((attention_fma_launch_hdim<96, T>(a, dev, stream))); break;
    case 128: RAGVIT_TRY((attention_fma_launch_hdim<128, T>(a, dev, stream))); break;
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "attention: head_dim must be one of 32, 64, 80, 96, 128, got %d",
                           (int)a->head_dim);
    }
    return a->cls_attn != nullptr ? attention_fma_cls_launch<T>(a, dev, stream) : RAGVIT_STATUS_OK;
}

ragvit_status attention_fma_launch(const ragvit_attention_args *a, const ragvit_device_info *dev,
                                   cudaStream_t stream) {
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: return attention_fma_launch_dtype<__half>(a, dev, stream);
    case RAGVIT_DTYPE_BF16: return attention_fma_launch_dtype<__nv_bfloat16>(a, dev, stream);
    case RAGVIT_DTYPE_F32: return attention_fma_launch_dtype<float>(a, dev, stream);
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "attention: q must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
}
