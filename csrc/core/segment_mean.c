/* segment_mean.c — host side of segment_mean: validate, fill
 * ragvit_segment_mean_args, hand it to cpu/segment_mean.c or kernels/segment_mean.cu.
 * Shapes: packed (T, C) channels contiguous; cu_seqlens (B+1,) int32; out (B, C)
 * of packed's dtype, channels contiguous. Decision: an empty range (length <=
 * skip) gives a zero row rather than NaN, so a pooled head stays finite and the
 * op needs no host-side knowledge of the lengths (graph-capturable). */
#include <inttypes.h>

#include "core/dispatch.h"
#include "core/tensor.h"

ragvit_status ragvit_segment_mean(ragvit_context *ctx, const ragvit_tensor *out,
                                  const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                  int64_t skip, void *stream) {
    static const char op[] = "segment_mean";
    const char *const names[] = {"packed", "cu_seqlens", "out"};
    const ragvit_tensor *const all[] = {packed, cu_seqlens, out};
    int32_t device_type = 0, device_id = 0;
    if (skip < 0 || skip > INT32_MAX) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: skip must be in [0, 2**31), got %" PRId64, op, skip);
    }
    RAGVIT_TRY(tensor_check_packed(op, packed, cu_seqlens));
    const int64_t out_shape[2] = {cu_seqlens->shape[0] - 1, packed->shape[1]};
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 2, out_shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "out", out, "packed", packed));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out));
    RAGVIT_TRY(tensor_check_devices(op, names, all, 3, &device_type, &device_id));
    for (int i = 0; i < 2; i++) RAGVIT_TRY(tensor_check_no_alias(op, "out", out, names[i], all[i]));
    if (device_type == RAGVIT_DEVICE_CPU) {
        RAGVIT_TRY(tensor_check_cu_seqlens_host(op, cu_seqlens, packed->shape[0], -1, NULL, NULL));
    }
    ragvit_segment_mean_args a = {
        .out = out->data,
        .packed = packed->data,
        .cu_seqlens = (const int32_t *)cu_seqlens->data,
        .out_stride_b = out->strides[0],
        .packed_stride_token = packed->strides[0],
        .cu_seqlens_stride = cu_seqlens->strides[0],
        .batch = out->shape[0],
        .channels = out->shape[1],
        .total_tokens = packed->shape[0],
        .skip = skip,
        .dtype = packed->dtype,
    };
    if (a.batch == 0 || a.channels == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_segment_mean(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    a.error_flag = dev->error_flag;
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_segment_mean(&a, dev, stream)));
}
