/* attention.c — host side of ragged attention: validate every argument once,
 * resolve max_seqlen and scale, fill ragvit_attention_args and hand it to
 * cpu/attention.c or kernels/attention.cu. Shapes: q, k, v, out (T, H, D), head dim
 * contiguous, any token/head strides; cu_seqlens (S+1,) int32; cls_attn and bias
 * (T,) float32, optional. Decision: host cu_seqlens and bias contents are checked
 * here (cheap); device contents are never read (that would sync): the kernels stay
 * in bounds on their own, non-finite bias values propagate, and the debug switch
 * reads the kernels' error flag back. */
#include <float.h>
#include <inttypes.h>
#include <math.h>

#include "core/dispatch.h"
#include "core/tensor.h"

static const char *const op = "attention";

/* The kernels scale logits by scale * log2(e) in float32 and flush subnormals to
 * zero: scale must be a normal float32 whose product with log2(e) is finite. */
#define ATTENTION_MAX_SCALE (FLT_MAX / 1.4426950408889634f)

static ragvit_status attention_fail_scale(double scale) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                       "%s: scale must be finite and > 0 in float32 (in [%g, %g], the kernels' "
                       "dtype), got %g",
                       op, (double)FLT_MIN, (double)ATTENTION_MAX_SCALE, scale);
}

static int is_supported_head_dim(int64_t d) {
    return d == 32 || d == 64 || d == 80 || d == 96 || d == 128;
}

static ragvit_status attention_check(const ragvit_tensor *out, const ragvit_tensor *cls_attn,
                                     const ragvit_tensor *q, const ragvit_tensor *k,
                                     const ragvit_tensor *v, const ragvit_tensor *cu_seqlens,
                                     const ragvit_tensor *bias, int32_t *device_type,
                                     int32_t *device_id) {
    /* inputs first: the alias checks below compare out against all[0 .. 4], cls_attn
     * against all[0 .. 5] */
    const char *const names[] = {"q", "k", "v", "cu_seqlens", "bias", "out", "cls_attn"};
    const ragvit_tensor *const all[] = {q, k, v, cu_seqlens, bias, out, cls_attn};
    RAGVIT_TRY(tensor_check_ndim(op, "q", q, 3));
    RAGVIT_TRY(tensor_check_float(op, "q", q));
    RAGVIT_TRY(tensor_check_shape(op, "k", k, 3, q->shape));
    RAGVIT_TRY(tensor_check_shape(op, "v", v, 3, q->shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "k", k, "q", q));
    RAGVIT_TRY(tensor_check_same_dtype(op, "v", v, "q", q));
    if (!is_supported_head_dim(q->shape[2])) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: head_dim must be one of 32, 64, 80, 96, 128, got %" PRId64, op,
                           q->shape[2]);
    }
    if (q->shape[0] > INT32_MAX) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: total_tokens must be < 2**31, got %" PRId64, op, q->shape[0]);
    }
    RAGVIT_TRY(tensor_check_last_contiguous(op, "q", q));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "k", k));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "v", v));
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 3, q->shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "out", out, "q", q));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out));
    RAGVIT_TRY(tensor_check_cu_seqlens(op, cu_seqlens));
    if (cu_seqlens->shape[0] - 1 > INT32_MAX) { /* the kernels count sequences in int32 */
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: cu_seqlens must hold at most 2^31-1 sequences (2^31 entries), "
                           "got %" PRId64 " entries",
                           op, cu_seqlens->shape[0]);
    }
    if (cu_seqlens->strides[0] != 1 && cu_seqlens->shape[0] > 1) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: cu_seqlens must be contiguous, got stride %" PRId64, op,
                           cu_seqlens->strides[0]);
    }
    if (cls_attn->is_present) {
        const int64_t shape[1] = {q->shape[0]};
        RAGVIT_TRY(tensor_check_shape(op, "cls_attn", cls_attn, 1, shape));
        RAGVIT_TRY(tensor_check_dtype(op, "cls_attn", cls_attn, RAGVIT_DTYPE_F32));
        RAGVIT_TRY(tensor_check_writable(op, "cls_attn", cls_attn));
        RAGVIT_TRY(tensor_check_no_self_overlap(op, "cls_attn", cls_attn));
    }
    if (bias->is_present) {
        const int64_t shape[1] = {q->shape[0]};
        RAGVIT_TRY(tensor_check_ndim(op, "bias", bias, 1));
        RAGVIT_TRY(tensor_check_dtype(op, "bias", bias, RAGVIT_DTYPE_F32));
        RAGVIT_TRY(tensor_check_shape(op, "bias", bias, 1, shape));
    }
    RAGVIT_TRY(tensor_check_devices(op, names, all, 7, device_type, device_id));
    RAGVIT_TRY(tensor_check_no_alias_any(op, "out", out, names, all, 5));
    return tensor_check_no_alias_any(op, "cls_attn", cls_attn, names, all, 6); /* out too */
}

/* Host bias: its values on the tokens of every sequence, [cu_seqlens[0], cu_seqlens[S])
 * (validated contents), must be finite: a NaN or inf would turn softmax rows into NaN
 * without saying why. Rows outside every sequence (a capacity tail) are never read. */
static ragvit_status attention_check_bias_host(const ragvit_tensor *bias,
                                               const ragvit_tensor *cu_seqlens) {
    const int32_t *cu = (const int32_t *)cu_seqlens->data;
    const int64_t first = cu[0];
    const int64_t end = cu[(cu_seqlens->shape[0] - 1) * cu_seqlens->strides[0]];
    const float *b = (const float *)bias->data;
    for (int64_t t = first; t < end; t++) {
        const float x = b[t * bias->strides[0]];
        if (!isfinite(x)) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: bias must be finite on the tokens of every sequence, got %g "
                               "at token %" PRId64,
                               op, (double)x, t);
        }
    }
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_attention(ragvit_context *ctx, const ragvit_tensor *out,
                               const ragvit_tensor *cls_attn, const ragvit_tensor *q,
                               const ragvit_tensor *k, const ragvit_tensor *v,
                               const ragvit_tensor *cu_seqlens, const ragvit_tensor *bias,
                               int64_t max_seqlen, const double *scale_or_null, void *stream) {
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(attention_check(out, cls_attn, q, k, v, cu_seqlens, bias, &device_type, &device_id));
    int64_t total_tokens = q->shape[0];
    if (max_seqlen != RAGVIT_MAX_SEQLEN_AUTO && (max_seqlen < 0 || max_seqlen > INT32_MAX)) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: max_seqlen must be in [0, 2**31), got %" PRId64, op, max_seqlen);
    }
    const double scale_in = scale_or_null ? *scale_or_null : 1.0 / sqrt((double)q->shape[2]);
    const float scale = (float)scale_in;
    if (!(scale >= FLT_MIN && scale <= ATTENTION_MAX_SCALE)) return attention_fail_scale(scale_in);
    if (device_type == RAGVIT_DEVICE_CPU) {
        int64_t longest = 0;
        RAGVIT_TRY(tensor_check_cu_seqlens_host(
            op, cu_seqlens, total_tokens, max_seqlen == RAGVIT_MAX_SEQLEN_AUTO ? -1 : max_seqlen,
            "max_seqlen", &longest));
        if (max_seqlen == RAGVIT_MAX_SEQLEN_AUTO) max_seqlen = longest;
        if (bias->is_present) RAGVIT_TRY(attention_check_bias_host(bias, cu_seqlens));
    } else if (max_seqlen == RAGVIT_MAX_SEQLEN_AUTO) {
        max_seqlen = total_tokens;
    }

    ragvit_attention_args a = {
        .out = out->data,
        .q = q->data,
        .k = k->data,
        .v = v->data,
        .cu_seqlens = (const int32_t *)cu_seqlens->data,
        .cls_attn = cls_attn->is_present ? (float *)cls_attn->data : NULL,
        .out_stride_token = out->strides[0],
        .out_stride_head = out->strides[1],
        .q_stride_token = q->strides[0],
        .q_stride_head = q->strides[1],
        .k_stride_token = k->strides[0],
        .k_stride_head = k->strides[1],
        .v_stride_token = v->strides[0],
        .v_stride_head = v->strides[1],
        .cls_attn_stride = cls_attn->is_present ? cls_attn->strides[0] : 0,
        .total_tokens = total_tokens,
        .num_seqs = (int32_t)(cu_seqlens->shape[0] - 1),
        .num_heads = (int32_t)q->shape[1],
        .head_dim = (int32_t)q->shape[2],
        .max_seqlen = (int32_t)max_seqlen,
        .scale = scale,
        .dtype = q->dtype,
        .bias = bias->is_present ? (const float *)bias->data : NULL,
        .bias_stride = bias->is_present ? bias->strides[0] : 0,
    };
    if (a.num_seqs == 0 || total_tokens == 0 || a.num_heads == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_attention(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    a.error_flag = dev->error_flag;
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_attention(&a, dev, stream)));
}
