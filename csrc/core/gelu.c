/* gelu.c — host side of gelu: the exact (erf) GELU of packed rows, validated by
 * tensor_check_rows, handed to cpu/gelu.c or kernels/gelu.cu. Shapes: x and out
 * (M, C), unit column stride, any row stride; out may be x itself (same strides),
 * any other overlap is refused. Decision: a single row's stride is passed as C:
 * an extent-1 dim may have any stride, and the kernel's 16-byte path needs row
 * strides that are 16-byte multiples. */
#include "core/dispatch.h"
#include "core/tensor.h"

ragvit_status ragvit_gelu(ragvit_context *ctx, const ragvit_tensor *out, const ragvit_tensor *x,
                          void *stream) {
    static const char op[] = "gelu";
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_rows(op, out, x, NULL, NULL, 0, &device_type, &device_id));
    const int64_t M = x->shape[0], C = x->shape[1];
    ragvit_rowwise_args a = {
        .out = out->data,
        .x = x->data,
        .out_stride = M > 1 ? out->strides[0] : C,
        .x_stride = M > 1 ? x->strides[0] : C,
        .rows = M,
        .channels = C,
        .dtype = x->dtype,
    };
    if (M == 0 || C == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_gelu(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_gelu(&a, dev, stream)));
}
