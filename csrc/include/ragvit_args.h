/* ragvit_args.h — the per-op argument structs: plain pointers, element strides and
 * sizes, the boundary between the core and both backends. The core (csrc/core/)
 * validates the caller's tensors and fills one struct per call; the C backend
 * (csrc/cpu/) and the CUDA launchers (csrc/kernels/launch.h) compute from it.
 * Decision: the structs hold already-validated raw pointers, in the style of
 * flash-attention's params struct; validation lives in the core. Backends stay in
 * bounds whatever cu_seqlens/keep/indices contain: they skip the offending sequence or
 * token and report it (kernels: a RAGVIT_ERROR_* bit in *error_flag). */
#ifndef RAGVIT_ARGS_H
#define RAGVIT_ARGS_H

#include "ragvit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* attention: for each sequence s, tokens [cu_seqlens[s], cu_seqlens[s+1]), and head h,
 * out = softmax(logits) v with logit[i][j] = scale q_i.k_j + bias[j] (all heads and
 * queries). Tokens outside every sequence are never written. A sequence with start
 * < 0, end < start, end > total_tokens or length > max_seqlen is skipped and flagged. */
typedef struct {
    /* (T, H, D) of dtype, head dim contiguous. */
    void *out;
    /* (T, H, D) of dtype, head dim contiguous, any token/head strides. */
    const void *q;
    const void *k;
    const void *v;
    /* (S+1,) int32, contiguous: exclusive prefix sums of the lengths. */
    const int32_t *cu_seqlens;
    /* (T,) float32 or NULL: at each sequence's tokens, the head-mean softmax
     * probabilities of its first query over its keys (bias included). */
    float *cls_attn;
    /* Device word for RAGVIT_ERROR_* bits (CUDA only). */
    unsigned int *error_flag;
    /* Element strides of the token and head dims of out, q, k, v. */
    int64_t out_stride_token, out_stride_head;
    int64_t q_stride_token, q_stride_head;
    int64_t k_stride_token, k_stride_head;
    int64_t v_stride_token, v_stride_head;
    /* Element stride of cls_attn. */
    int64_t cls_attn_stride;
    /* T: rows of out, q, k, v. */
    int64_t total_tokens;
    /* S. */
    int32_t num_seqs;
    /* H. */
    int32_t num_heads;
    /* D. */
    int32_t head_dim;
    /* Upper bound on every length: sizes the grid; a longer sequence is skipped. */
    int32_t max_seqlen;
    /* Multiplies q_i.k_j before the bias is added. */
    float scale;
    /* ragvit_dtype of out, q, k, v: F16, BF16 or F32. */
    int32_t dtype;
    /* (T,) float32 or NULL: bias[j * bias_stride] is added to every logit of key j.
     * Last, so the no-bias kernels read every other field at the same offset. */
    const float *bias;
    int64_t bias_stride;
} ragvit_attention_args;

/* pack and repack. pack: x (B, N, C), keep (B, N). repack: x is packed (T, C) and
 * keep (T,) (x_stride_b = keep_stride_b = 0, seqlen = T); image b is rows
 * [cu_seqlens_in[b], cu_seqlens_in[b+1]), and an image whose range is negative,
 * decreasing or past T is empty and flagged (RAGVIT_ERROR_BAD_CU_SEQLENS). The count
 * writes cu_seqlens; the gather reads it and writes out and indices_out. Rows >=
 * capacity are not written (RAGVIT_ERROR_CAPACITY). */
typedef struct {
    /* (capacity, C) of x's dtype, channels contiguous: the kept rows, packed. */
    void *out;
    /* (capacity,) int32 or NULL: the source row of each packed row (pack: n within
     * its image; repack: the row of x; -1 for the fused token). */
    int32_t *indices_out;
    /* pack: (B, N, C); repack: (T, C); channels contiguous. */
    const void *x;
    /* pack: (B, N); repack: (T,); one byte an element, nonzero = keep. */
    const uint8_t *keep;
    /* (B+1,) int32: written by the count, read by the gather. */
    int32_t *cu_seqlens;
    /* Device word for RAGVIT_ERROR_* bits (CUDA only). */
    unsigned int *error_flag;
    /* Element stride of out's rows. */
    int64_t out_stride_token;
    /* Element stride of indices_out. */
    int64_t indices_stride;
    /* Element strides of x's image and token dims (repack: 0 and the row stride). */
    int64_t x_stride_b, x_stride_n;
    /* Element strides of keep's image and token dims (repack: 0 and the stride). */
    int64_t keep_stride_b, keep_stride_n;
    /* Element stride of cu_seqlens. */
    int64_t cu_seqlens_stride;
    /* B. */
    int64_t batch;
    /* N (repack: T). */
    int64_t seqlen;
    /* C. */
    int64_t channels;
    /* Rows of out (and of indices_out). */
    int64_t capacity;
    /* repack: (B+1,) int32, the input's sequences; NULL for pack. */
    const int32_t *cu_seqlens_in;
    int64_t cu_seqlens_in_stride;
    /* repack, EViT token fusion: (T,) float32 weights. Every image gets one more row
     * after its kept rows, sum(w x) / sum(w) over its dropped rows in float32 (zeros
     * when sum(w) == 0, e.g. nothing dropped), with index -1; the counts in
     * cu_seqlens include it. */
    const float *fuse_weights;
    int64_t fuse_weights_stride;
    /* 1 when fuse_weights was given (its data may be NULL when T == 0). */
    int32_t is_fusing;
    /* Bytes per element of x and out: 2 or 4. */
    int32_t elem_size;
    /* F16, BF16 or F32 (the fused token's arithmetic). */
    int32_t dtype;
} ragvit_pack_args;

/* unpack and gather_prefix: image b of out gets the rows of sequence b of packed,
 * [cu_seqlens[b], cu_seqlens[b+1]), in order or at indices; every row of out not
 * written from packed is set to fill. */
typedef struct {
    /* (B, N, C) of packed's dtype, channels contiguous. */
    void *out;
    /* (T, C), channels contiguous. */
    const void *packed;
    /* (B+1,) int32. */
    const int32_t *cu_seqlens;
    /* (T,) int32 target positions in [0, N), or NULL for "the first len rows". */
    const int32_t *indices;
    /* Device word for RAGVIT_ERROR_* bits (CUDA only). */
    unsigned int *error_flag;
    /* Element strides of out's image and token dims. */
    int64_t out_stride_b, out_stride_n;
    /* Element stride of packed's rows. */
    int64_t packed_stride_token;
    /* Element stride of cu_seqlens. */
    int64_t cu_seqlens_stride;
    /* Element stride of indices. */
    int64_t indices_stride;
    /* B. */
    int64_t batch;
    /* N (gather_prefix: k). */
    int64_t seqlen;
    /* C. */
    int64_t channels;
    /* T. */
    int64_t total_tokens;
    /* The value of every row not written from packed, rounded once to dtype. */
    double fill;
    /* F16, BF16 or F32. */
    int32_t dtype;
    /* gather_prefix (N = k, no indices): lengths above N are normal (the first N rows
     * are copied) and lengths below N are flagged RAGVIT_ERROR_SHORT_SEQ. */
    int32_t is_prefix;
} ragvit_unpack_args;

/* segment_mean: out[b] = mean of rows [cu[b] + skip, cu[b+1]) of packed in float32,
 * zeros when that range is empty, zeros and RAGVIT_ERROR_BAD_CU_SEQLENS when cu is
 * negative, decreasing or past T. */
typedef struct {
    /* (B, C) of packed's dtype, channel stride 1. */
    void *out;
    /* (T, C), channels contiguous. */
    const void *packed;
    /* (B+1,) int32. */
    const int32_t *cu_seqlens;
    /* Device word for RAGVIT_ERROR_* bits (CUDA only). */
    unsigned int *error_flag;
    /* Element stride of out's rows. */
    int64_t out_stride_b;
    /* Element stride of packed's rows. */
    int64_t packed_stride_token;
    /* Element stride of cu_seqlens. */
    int64_t cu_seqlens_stride;
    /* B. */
    int64_t batch;
    /* C. */
    int64_t channels;
    /* T. */
    int64_t total_tokens;
    /* Rows left out at the start of every sequence (e.g. 1 for the CLS token). */
    int64_t skip;
    /* F16, BF16 or F32. */
    int32_t dtype;
} ragvit_segment_mean_args;

/* linear: out = x . weight^T + bias + residual on packed rows, one dtype (F16, BF16,
 * F32) for all, rounded once. CUDA: cuBLASLt, float32 accumulation (F32: no TF32),
 * the bias epilogue and beta = 1 on residual; the C backend accumulates in double.
 * Rows have unit column stride and any row stride (a single row's is its width). */
typedef struct {
    /* (M, N). */
    void *out;
    /* (M, K). */
    const void *x;
    /* (N, K), as nn.Linear stores it. */
    const void *weight;
    /* (N,) or NULL. */
    const void *bias;
    /* (M, N) or NULL; may be out itself (same strides). */
    const void *residual;
    /* Element row strides of out, x, weight, residual. */
    int64_t out_stride;
    int64_t x_stride;
    int64_t weight_stride;
    int64_t residual_stride;
    /* Element stride of bias: 1 (the bias epilogue reads it densely). */
    int64_t bias_stride;
    /* M. */
    int64_t rows;
    /* N, output features. */
    int64_t cols;
    /* K, input features. */
    int64_t inner;
    /* F16, BF16 or F32. */
    int32_t dtype;
} ragvit_linear_args;

/* The row-wise ops, layer_norm and gelu, on packed rows; out may be x itself (in
 * place, same strides). layer_norm: out = (x - mean) / sqrt(var + eps) * weight +
 * bias per row (biased variance). gelu: out = x * Phi(x), the exact erf form
 * (torch's default). The kernels compute in float32, the C backend in double; both
 * round once on store. */
typedef struct {
    /* (M, C) of x's dtype, unit column stride. */
    void *out;
    /* (M, C), unit column stride. */
    const void *x;
    /* layer_norm: (C,) of x's dtype, or NULL for 1; gelu: unused. */
    const void *weight;
    /* layer_norm: (C,) of x's dtype, or NULL for 0; gelu: unused. */
    const void *bias;
    /* Element row strides of out and x (a single row's is C). */
    int64_t out_stride;
    int64_t x_stride;
    /* Element strides of weight and bias. */
    int64_t weight_stride;
    int64_t bias_stride;
    /* M. */
    int64_t rows;
    /* C. */
    int64_t channels;
    /* layer_norm's epsilon, in (0, 1]; gelu: unused. */
    float eps;
    /* F16, BF16 or F32. */
    int32_t dtype;
} ragvit_rowwise_args;

/* topk_index: out[b] holds, in ascending order, the columns 0..prefix-1 and the k
 * columns of [prefix, L) with the highest scores: ties keep the lower column, NaN
 * ranks above every number, -0.0 equals +0.0. 0 <= prefix, 0 <= k, prefix + k <= L
 * <= RAGVIT_TOPK_MAX_COLS (checked by the core; the launcher refuses the rest). */
typedef struct {
    /* (B, prefix + k) of out_dtype, unit column stride. */
    void *out;
    /* (B, L) of dtype, unit column stride. */
    const void *scores;
    /* Element row strides of out and scores. */
    int64_t out_stride_b;
    int64_t scores_stride_b;
    /* B. */
    int64_t batch;
    /* L. */
    int64_t cols;
    /* Leading columns always kept. */
    int64_t prefix;
    /* Columns chosen among [prefix, L). */
    int64_t k;
    /* Of scores: F16, BF16 or F32. */
    int32_t dtype;
    /* Of out: I32 or I64. */
    int32_t out_dtype;
} ragvit_topk_index_args;

/* graph_replay: static_x <- x, launch graph_exec, outs[i] <- static_outs[i], on one
 * stream. Byte counts of compact tensors; a copy of 0 bytes, or of x onto itself, is
 * skipped. */
typedef struct {
    /* cudaGraphExec_t. */
    void *graph_exec;
    /* The graph's input and the caller's, x_bytes each. */
    void *static_x;
    const void *x;
    size_t x_bytes;
    /* Fresh outputs and the graph's, out_bytes[i] each, i < count. */
    void *outs[RAGVIT_GRAPH_MAX_OUTPUTS];
    const void *static_outs[RAGVIT_GRAPH_MAX_OUTPUTS];
    size_t out_bytes[RAGVIT_GRAPH_MAX_OUTPUTS];
    int32_t count;
} ragvit_graph_replay_args;

#ifdef __cplusplus
}
#endif
#endif /* RAGVIT_ARGS_H */
