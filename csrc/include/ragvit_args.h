/* ragvit_args.h — the per-op argument structs: plain pointers, element strides and
 * sizes, the boundary between the core and both backends. The core (csrc/core/)
 * validates the caller's tensors and fills one struct per call; the C backend
 * (csrc/cpu/) and the CUDA launchers (csrc/kernels/launch.h) compute from the same
 * struct, so both backends read one description of each call.
 *
 * Decision: the structs carry already-validated raw pointers, in the style of
 * flash-attention's params struct; validation lives in the core, never in a backend.
 * Kernels never read or write out of bounds whatever cu_seqlens/keep/indices
 * contain: they skip the offending sequence or token and OR a RAGVIT_ERROR_* bit
 * into *error_flag. No Python or CUDA header is included here. */
#ifndef RAGVIT_ARGS_H
#define RAGVIT_ARGS_H

#include "ragvit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out, q, k, v: (T, H, D) of one dtype (F16, BF16, F32), head dim contiguous;
 * cu_seqlens: (S+1,) int32; cls_attn: (T,) float32 or NULL; bias: (T,) float32
 * or NULL, added to every logit of key j (logit[i][j] = scale q_i.k_j + bias[j],
 * all heads and queries; cls_attn includes it). Sequence s covers
 * tokens [cu_seqlens[s], cu_seqlens[s+1]); tokens outside every sequence are
 * never written. A sequence with start < 0, end < start, end > total_tokens
 * or length > max_seqlen is skipped and flagged. */
typedef struct {
    void *out;
    const void *q;
    const void *k;
    const void *v;
    const int32_t *cu_seqlens;
    float *cls_attn;
    unsigned int *error_flag;
    int64_t out_stride_token, out_stride_head;
    int64_t q_stride_token, q_stride_head;
    int64_t k_stride_token, k_stride_head;
    int64_t v_stride_token, v_stride_head;
    int64_t cls_attn_stride;
    int64_t total_tokens;
    int32_t num_seqs;
    int32_t num_heads;
    int32_t head_dim;
    int32_t max_seqlen;
    float scale;
    int32_t dtype; /* ragvit_dtype */
    /* Last, so the no-bias kernels read every other field at the same offset. */
    const float *bias;
    int64_t bias_stride;
} ragvit_attention_args;

/* pack: x (B, N, C); keep (B, N) of 1-byte elements (nonzero = keep).
 * repack: x is packed (T, C) and keep (T,) (x_stride_b = keep_stride_b = 0,
 * seqlen = T); image b is rows [cu_seqlens_in[b], cu_seqlens_in[b+1]), and an
 * image whose range is negative, decreasing or past T is empty and flagged
 * (RAGVIT_ERROR_BAD_CU_SEQLENS). cu_seqlens: (B+1,) int32 (written by count,
 * read by gather); out: (capacity, C) same dtype as x; indices_out:
 * (capacity,) int32 source row of each packed token (pack: n within its image;
 * repack: the row of x), or NULL. Rows >= capacity are not written
 * (RAGVIT_ERROR_CAPACITY). fuse_weights (EViT token fusion): every image gets
 * one more row after its kept rows, sum(w x) / sum(w) over its dropped rows in
 * float32 (zeros when sum(w) == 0, e.g. nothing dropped), with index -1; the
 * counts in cu_seqlens include it. */
typedef struct {
    void *out;
    int32_t *indices_out;
    const void *x;
    const uint8_t *keep;
    int32_t *cu_seqlens;
    unsigned int *error_flag;
    int64_t out_stride_token;
    int64_t indices_stride;
    int64_t x_stride_b, x_stride_n;
    int64_t keep_stride_b, keep_stride_n;
    int64_t cu_seqlens_stride;
    int64_t batch;    /* B */
    int64_t seqlen;   /* N */
    int64_t channels; /* C */
    int64_t capacity;
    const int32_t *cu_seqlens_in; /* repack only; NULL for pack */
    int64_t cu_seqlens_in_stride;
    const float *fuse_weights; /* repack only: (T,) weights of the fused token */
    int64_t fuse_weights_stride;
    int32_t is_fusing; /* fuse_weights given (its data may be NULL when T == 0) */
    int32_t elem_size; /* bytes per element of x / out: 2 or 4 */
    int32_t dtype;     /* F16, BF16 or F32 (the fused token's arithmetic) */
} ragvit_pack_args;

/* out: (B, N, C); packed: (T, C) same dtype; cu_seqlens: (B+1,) int32;
 * indices: (T,) int32 target positions, or NULL for "first len rows". Every
 * row of out not written from packed is set to fill. is_prefix (gather_prefix,
 * N = k, no indices): lengths above N are normal (the first N rows are
 * copied) and lengths below N are flagged RAGVIT_ERROR_SHORT_SEQ instead. */
typedef struct {
    void *out;
    const void *packed;
    const int32_t *cu_seqlens;
    const int32_t *indices;
    unsigned int *error_flag;
    int64_t out_stride_b, out_stride_n;
    int64_t packed_stride_token;
    int64_t cu_seqlens_stride;
    int64_t indices_stride;
    int64_t batch;        /* B */
    int64_t seqlen;       /* N */
    int64_t channels;     /* C */
    int64_t total_tokens; /* T */
    double fill;
    int32_t dtype; /* F16, BF16 or F32 */
    int32_t is_prefix;
} ragvit_unpack_args;

/* out: (B, C) of packed's dtype, channel stride 1; packed: (T, C);
 * cu_seqlens: (B+1,) int32. out[b] = mean of rows [cu[b] + skip, cu[b+1]) in
 * float32, zeros when that range is empty, zeros and RAGVIT_ERROR_BAD_CU_SEQLENS
 * when cu is negative, decreasing or past T. */
typedef struct {
    void *out;
    const void *packed;
    const int32_t *cu_seqlens;
    unsigned int *error_flag;
    int64_t out_stride_b;
    int64_t packed_stride_token;
    int64_t cu_seqlens_stride;
    int64_t batch;        /* B */
    int64_t channels;     /* C */
    int64_t total_tokens; /* T */
    int64_t skip;
    int32_t dtype; /* F16, BF16 or F32 */
} ragvit_segment_mean_args;

/* Dense per-row ops of a transformer block on packed rows (T = M rows).
 * linear: out (M, N) = x (M, K) . weight (N, K)^T + bias (N,) + residual (M, N),
 * one dtype (F16, BF16, F32), float32 accumulation (F32: no TF32), rounded once;
 * rows of x, weight, residual and out have unit column stride and any row
 * stride; bias (contiguous) and residual may be NULL; residual may equal out
 * (same strides).
 * CUDA: cuBLASLt (bias epilogue, beta = 1 on residual); the CPU backend
 * accumulates in double. */
typedef struct {
    void *out;
    const void *x;
    const void *weight;
    const void *bias;
    const void *residual;
    int64_t out_stride;
    int64_t x_stride;
    int64_t weight_stride;
    int64_t residual_stride;
    int64_t bias_stride;
    int64_t rows;  /* M */
    int64_t cols;  /* N, output features */
    int64_t inner; /* K, input features */
    int32_t dtype;
} ragvit_linear_args;

/* layer_norm: out (M, C) = (x - mean) / sqrt(var + eps) * weight + bias per
 * row, statistics in float32 (biased variance); weight and bias (C,) of x's
 * dtype, each may be NULL (1 and 0). gelu: out = x * Phi(x) (the exact erf
 * form, torch's default), float32 arithmetic; weight/bias unused. out may be
 * x itself (in place, same strides). */
typedef struct {
    void *out;
    const void *x;
    const void *weight;
    const void *bias;
    int64_t out_stride;
    int64_t x_stride;
    int64_t weight_stride;
    int64_t bias_stride;
    int64_t rows;     /* M */
    int64_t channels; /* C */
    float eps;
    int32_t dtype;
} ragvit_rowwise_args;

/* topk_index: scores (B, L) F16/BF16/F32, unit column stride, any row stride;
 * out (B, prefix + k) int32 or int64, unit column stride. out[b] holds, in
 * ascending order, the columns 0..prefix-1 and the k columns of [prefix, L)
 * with the highest scores: ties keep the lower column, NaN ranks above every
 * number, -0.0 equals +0.0. 0 <= prefix, 0 <= k, prefix + k <= L <=
 * RAGVIT_TOPK_MAX_COLS (checked by the core; the launcher refuses the rest). */
typedef struct {
    void *out;
    const void *scores;
    int64_t out_stride_b;
    int64_t scores_stride_b;
    int64_t batch;     /* B */
    int64_t cols;      /* L */
    int64_t prefix;    /* leading columns always kept */
    int64_t k;         /* columns chosen among [prefix, L) */
    int32_t dtype;     /* of scores: F16, BF16 or F32 */
    int32_t out_dtype; /* I32 or I64 */
} ragvit_topk_index_args;

#ifdef __cplusplus
}
#endif
#endif /* RAGVIT_ARGS_H */
