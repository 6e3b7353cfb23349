/* layer_norm.c — host side of layer_norm: LayerNorm over the last dim of packed
 * rows, validated by tensor_check_rows, handed to cpu/layer_norm.c or
 * kernels/layer_norm.cu. Shapes: x and out (M, C), unit column stride, any row
 * stride; weight and bias (C,) of x's dtype, each optional; out may be x itself
 * (same strides), any other overlap is refused. Decision: a single row's stride
 * is passed as C: an extent-1 dim may have any stride, and the kernel's 16-byte
 * path needs row strides that are 16-byte multiples. */
#include <float.h>
#include <math.h>

#include "core/dispatch.h"
#include "core/tensor.h"

ragvit_status ragvit_layer_norm(ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *x, const ragvit_tensor *weight,
                                const ragvit_tensor *bias, double eps, void *stream) {
    static const char op[] = "layer_norm";
    const char *const names[] = {"weight", "bias"};
    const ragvit_tensor *const params[] = {weight, bias};
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_rows(op, out, x, names, params, 2, &device_type, &device_id));
    if (!(isfinite(eps) && eps > 0.0 && eps <= 1.0)) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: eps must be finite and in (0, 1], got %g", op, eps);
    }
    if (!((float)eps >= FLT_MIN)) { /* the kernels add it in float32 and flush subnormals */
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: eps must be >= %g (the smallest normal float32) in float32, the "
                           "kernels' dtype, got %g",
                           op, (double)FLT_MIN, eps);
    }
    const int64_t M = x->shape[0], C = x->shape[1];
    ragvit_rowwise_args a = {
        .out = out->data,
        .x = x->data,
        .weight = weight->is_present ? weight->data : NULL,
        .bias = bias->is_present ? bias->data : NULL,
        .out_stride = M > 1 ? out->strides[0] : C,
        .x_stride = M > 1 ? x->strides[0] : C,
        .weight_stride = weight->is_present ? weight->strides[0] : 0,
        .bias_stride = bias->is_present ? bias->strides[0] : 0,
        .rows = M,
        .channels = C,
        .eps = (float)eps,
        .dtype = x->dtype,
    };
    if (M == 0 || C == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_layer_norm(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_layer_norm(&a, dev, stream)));
}
