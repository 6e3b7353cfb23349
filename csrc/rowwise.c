/* rowwise.c — host side of the per-row ops of a transformer block on packed
 * rows: layer_norm (LayerNorm over the last dim) and gelu (exact erf GELU).
 * Shapes: x and out (M, C), unit column stride, any row stride; weight and bias
 * (C,) of x's dtype. out may be x itself (in place, same strides); any other
 * overlap is refused. Decision: statistics and GELU are float32 whatever the
 * dtype, rounded once on store, as torch computes them. */
#include <math.h>

#include "cpu_backend.h"
#include "tensor.h"

typedef enum { ROWWISE_LAYER_NORM, ROWWISE_GELU } rowwise_op;

static ragvit_status rowwise_forward(ragvit_context *ctx, rowwise_op kind, const char *op,
                                     const ragvit_tensor *out, const ragvit_tensor *x,
                                     const ragvit_tensor *weight, const ragvit_tensor *bias,
                                     double eps, void *stream) {
    const char *const names[] = {"x", "weight", "bias", "out"};
    const ragvit_tensor *const all[] = {x, weight, bias, out};
    int32_t device_type = 0, device_id = 0;
    TRY(tensor_check_ndim(op, "x", x, 2));
    TRY(tensor_check_float(op, "x", x));
    TRY(tensor_check_last_contiguous(op, "x", x));
    const int64_t M = x->shape[0], C = x->shape[1];
    const int64_t shape[2] = {M, C}, vec[1] = {C};
    TRY(tensor_check_shape(op, "out", out, 2, shape));
    TRY(tensor_check_same_dtype(op, "out", out, "x", x));
    TRY(tensor_check_last_contiguous(op, "out", out));
    TRY(tensor_check_writable(op, "out", out));
    for (int i = 1; i < 3; i++) {
        if (!all[i]->is_present) continue;
        TRY(tensor_check_shape(op, names[i], all[i], 1, vec));
        TRY(tensor_check_same_dtype(op, names[i], all[i], "x", x));
    }
    TRY(tensor_check_devices(op, names, all, 4, &device_type, &device_id));
    if (out->data == x->data && M > 1 && C > 0) {
        if (out->strides[0] != x->strides[0]) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                               "%s: out must have x's row stride when it is x (in place), got "
                               "%lld and %lld",
                               op, (long long)out->strides[0], (long long)x->strides[0]);
        }
    } else if (out->data != x->data) {
        TRY(tensor_check_no_alias(op, "out", out, "x", x));
    }
    for (int i = 1; i < 3; i++) TRY(tensor_check_no_alias(op, "out", out, names[i], all[i]));
    if (kind == ROWWISE_LAYER_NORM && !(isfinite(eps) && eps > 0.0 && eps <= 1.0)) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: eps must be finite and in (0, 1], got %g", op, eps);
    }
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
    if (device_type == RAGVIT_DEVICE_CPU) {
        return kind == ROWWISE_LAYER_NORM ? ragvit_cpu_layer_norm(&a) : ragvit_cpu_gelu(&a);
    }
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    TRY(ragvit_context_device(ctx, device_id, &dev));
    TRY(kind == ROWWISE_LAYER_NORM ? ragvit_cuda_layer_norm(&a, dev, stream)
                                   : ragvit_cuda_gelu(&a, dev, stream));
    return ragvit_context_finish(ctx, device_id, stream, op);
#else
    (void)ctx;
    (void)stream;
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "%s: x must be a CPU array in this CPU-only build, got a CUDA array", op);
#endif
}

ragvit_status ragvit_layer_norm_forward(ragvit_context *ctx, const ragvit_tensor *out,
                                        const ragvit_tensor *x, const ragvit_tensor *weight,
                                        const ragvit_tensor *bias, double eps, void *stream) {
    return rowwise_forward(ctx, ROWWISE_LAYER_NORM, "layer_norm", out, x, weight, bias, eps,
                           stream);
}

ragvit_status ragvit_gelu_forward(ragvit_context *ctx, const ragvit_tensor *out,
                                  const ragvit_tensor *x, void *stream) {
    static const ragvit_tensor absent = {0};
    return rowwise_forward(ctx, ROWWISE_GELU, "gelu", out, x, &absent, &absent, 1e-5, stream);
}
