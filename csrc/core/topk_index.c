/* topk_index.c — host side of topk_index: validate, fill ragvit_topk_index_args,
 * hand it to cpu/topk_index.c or kernels/topk_index.cu.
 * Shapes: scores (B, L) float16/bfloat16/float32, unit column stride, any row
 * stride; out (B, prefix + k) int32 or int64, unit column stride, rows that do
 * not overlap. Decision: L is capped at RAGVIT_TOPK_MAX_COLS (8192) so a row's
 * keys fit one block's shared memory: one launch, no workspace, no host sync
 * (graph-capturable), and ViT token counts are far below the cap. */
#include <inttypes.h>

#include "core/dispatch.h"
#include "core/tensor.h"

ragvit_status ragvit_topk_index(ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *scores, int64_t k, int64_t prefix,
                                void *stream) {
    static const char op[] = "topk_index";
    const char *const names[] = {"scores", "out"};
    const ragvit_tensor *const all[] = {scores, out};
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_ndim(op, "scores", scores, 2));
    RAGVIT_TRY(tensor_check_float(op, "scores", scores));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "scores", scores));
    const int64_t B = scores->shape[0], L = scores->shape[1];
    if (L > RAGVIT_TOPK_MAX_COLS) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: scores must have L <= %d columns, got L=%" PRId64, op,
                           RAGVIT_TOPK_MAX_COLS, L);
    }
    if (prefix < 0 || prefix > L) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: prefix must be in [0, L=%" PRId64 "], got %" PRId64, op, L, prefix);
    }
    if (k < 0 || k > L - prefix) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: k must be in [0, L - prefix] (k + prefix <= L), got k=%" PRId64
                           " with prefix=%" PRId64 " and L=%" PRId64,
                           op, k, prefix, L);
    }
    if (!out->is_present) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE, "%s: out must be an array, got none", op);
    }
    const int64_t width = prefix + k;
    const int64_t out_shape[2] = {B, width};
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 2, out_shape));
    if (out->dtype != RAGVIT_DTYPE_I32 && out->dtype != RAGVIT_DTYPE_I64) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE, "%s: out must be int32 or int64, got %s",
                           op, tensor_dtype_name(out->dtype));
    }
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out)); /* rows: |row stride| >= width */
    RAGVIT_TRY(tensor_check_devices(op, names, all, 2, &device_type, &device_id));
    RAGVIT_TRY(tensor_check_no_alias(op, "out", out, "scores", scores));
    ragvit_topk_index_args a = {
        .out = out->data,
        .scores = scores->data,
        .out_stride_b = out->strides[0],
        .scores_stride_b = scores->strides[0],
        .batch = B,
        .cols = L,
        .prefix = prefix,
        .k = k,
        .dtype = scores->dtype,
        .out_dtype = out->dtype,
    };
    if (B == 0 || width == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_topk_index(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_topk_index(&a, dev, stream)));
}
