/* linear.c — host side of linear: validate, fill ragvit_linear_args, hand it to
 * cpu/linear.c or the cuBLASLt launcher (kernels/linear.cu).
 * Shapes: x (M, K), weight (N, K) as nn.Linear stores it, bias (N,) contiguous,
 * residual and out (M, N); unit column strides, any row strides (x may be a
 * view of a wider buffer). Decision: the residual add of a transformer block is
 * the GEMM's residual epilogue (beta = 1 on residual, which may be out itself), so
 * a block half is one GEMM launch instead of a GEMM and an add, and one Python
 * call instead of two. */
#include "core/dispatch.h"
#include "core/tensor.h"

/* A rank-2 float matrix with unit column stride and a row stride that keeps
 * rows apart (>= cols, or any when there is at most one row). */
static ragvit_status linear_check_matrix(const char *op, const char *name, const ragvit_tensor *t,
                                         const int64_t shape[2]) {
    RAGVIT_TRY(tensor_check_shape(op, name, t, 2, shape));
    RAGVIT_TRY(tensor_check_last_contiguous(op, name, t));
    if (t->shape[0] > 1 && t->shape[1] > 0 && t->strides[0] < t->shape[1]) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must have a row stride >= its %lld columns, got %lld", op, name,
                           (long long)t->shape[1], (long long)t->strides[0]);
    }
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_linear(ragvit_context *ctx, const ragvit_tensor *out, const ragvit_tensor *x,
                            const ragvit_tensor *weight, const ragvit_tensor *bias,
                            const ragvit_tensor *residual, void *stream) {
    static const char op[] = "linear";
    const char *const names[] = {"x", "weight", "bias", "residual", "out"};
    const ragvit_tensor *const all[] = {x, weight, bias, residual, out};
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_ndim(op, "x", x, 2));
    RAGVIT_TRY(tensor_check_float(op, "x", x));
    RAGVIT_TRY(tensor_check_ndim(op, "weight", weight, 2));
    const int64_t M = x->shape[0], K = x->shape[1], N = weight->shape[0];
    const int64_t x_shape[2] = {M, K}, w_shape[2] = {N, K}, out_shape[2] = {M, N};
    RAGVIT_TRY(linear_check_matrix(op, "x", x, x_shape));
    RAGVIT_TRY(linear_check_matrix(op, "weight", weight, w_shape));
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 2, out_shape));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out)); /* before its row-stride rule */
    RAGVIT_TRY(linear_check_matrix(op, "out", out, out_shape));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    for (int i = 1; i < 5; i++) {
        if (all[i]->is_present) RAGVIT_TRY(tensor_check_same_dtype(op, names[i], all[i], "x", x));
    }
    if (bias->is_present) {
        const int64_t b_shape[1] = {N};
        RAGVIT_TRY(tensor_check_shape(op, "bias", bias, 1, b_shape));
        if (N > 1 && bias->strides[0] != 1) { /* cuBLASLt's bias epilogue reads it densely */
            return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                               "%s: bias must be contiguous (stride 1), got stride %lld", op,
                               (long long)bias->strides[0]);
        }
    }
    if (residual->is_present) {
        RAGVIT_TRY(linear_check_matrix(op, "residual", residual, out_shape));
        if (residual->data == out->data) {
            if (residual->strides[0] != out->strides[0] && M > 1) {
                return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                   "%s: residual must have out's row stride when it is out "
                                   "(in place), got %lld and %lld",
                                   op, (long long)residual->strides[0], (long long)out->strides[0]);
            }
        } else {
            RAGVIT_TRY(tensor_check_no_alias(op, "out", out, "residual", residual));
        }
    }
    RAGVIT_TRY(tensor_check_devices(op, names, all, 5, &device_type, &device_id));
    RAGVIT_TRY(tensor_check_no_alias_any(op, "out", out, names, all, 3));
    if (K == 0 && M > 0 && N > 0) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: x must have at least one column (in_features), got 0", op);
    }
    ragvit_linear_args a = {
        .out = out->data,
        .x = x->data,
        .weight = weight->data,
        .bias = bias->is_present ? bias->data : NULL,
        .residual = residual->is_present ? residual->data : NULL,
        .out_stride = M > 1 ? out->strides[0] : N,
        .x_stride = M > 1 ? x->strides[0] : K,
        .weight_stride = N > 1 ? weight->strides[0] : K,
        .residual_stride = residual->is_present && M > 1 ? residual->strides[0] : N,
        .bias_stride = 1,
        .rows = M,
        .cols = N,
        .inner = K,
        .dtype = x->dtype,
    };
    if (M == 0 || N == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_linear(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_linear(&a, dev, stream)));
}
