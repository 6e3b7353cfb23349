/* pack.c — host side of the token packer: validate, fill ragvit_pack_args /
 * ragvit_unpack_args, dispatch to the CPU backend or the CUDA launchers.
 * Shapes: x (B, N, C) channels contiguous; keep (B, N) bool/uint8; packed
 * (capacity, C); cu_seqlens (B+1,) int32; indices (capacity,) int32.
 * Decision: packing is two steps (count, then gather) so the eager form can
 * learn T on the host between them, while pack_into validates once and
 * enqueues both steps with no host sync (a single fused launch is issue 4). */
#include <inttypes.h>

#include "cpu_backend.h"
#include "tensor.h"

static ragvit_status pack_check_keep(const char *op, const ragvit_tensor *keep) {
    TRY(tensor_check_ndim(op, "keep", keep, 2));
    if (keep->dtype != RAGVIT_DTYPE_BOOL && keep->dtype != RAGVIT_DTYPE_U8) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE, "%s: keep must be bool or uint8, got %s",
                           op, tensor_dtype_name(keep->dtype));
    }
    return RAGVIT_STATUS_OK;
}

static ragvit_status pack_check_cu_seqlens(const char *op, const ragvit_tensor *cu_seqlens,
                                           int64_t batch, int is_output) {
    const int64_t shape[1] = {batch + 1};
    TRY(tensor_check_dtype(op, "cu_seqlens", cu_seqlens, RAGVIT_DTYPE_I32));
    TRY(tensor_check_shape(op, "cu_seqlens", cu_seqlens, 1, shape));
    return is_output ? tensor_check_writable(op, "cu_seqlens", cu_seqlens) : RAGVIT_STATUS_OK;
}

#ifdef RAGVIT_WITH_CUDA
static ragvit_status pack_finish(ragvit_context *ctx, int32_t device_id, void *stream,
                                 const char *op) {
    return ctx->is_debug ? ragvit_context_check_device(ctx, device_id, stream, op)
                         : RAGVIT_STATUS_OK;
}
#else
static ragvit_status pack_no_cuda(const char *op) {
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "%s: arrays must be on the CPU in this CPU-only build, got CUDA arrays", op);
}
#endif

/* Validates keep + cu_seqlens_out and fills the count part of a. */
static ragvit_status pack_count_check(const char *op, ragvit_pack_args *a,
                                      const ragvit_tensor *cu_seqlens_out,
                                      const ragvit_tensor *keep) {
    TRY(pack_check_keep(op, keep));
    TRY(pack_check_cu_seqlens(op, cu_seqlens_out, keep->shape[0], 1));
    TRY(tensor_check_no_alias(op, "cu_seqlens", cu_seqlens_out, "keep", keep));
    a->keep = (const uint8_t *)keep->data;
    a->keep_stride_b = keep->strides[0];
    a->keep_stride_n = keep->strides[1];
    a->cu_seqlens = (int32_t *)cu_seqlens_out->data;
    a->cu_seqlens_stride = cu_seqlens_out->strides[0];
    a->batch = keep->shape[0];
    a->seqlen = keep->shape[1];
    return RAGVIT_STATUS_OK;
}

/* Validates the gather arguments and fills the rest of a. */
static ragvit_status pack_gather_check(const char *op, ragvit_pack_args *a,
                                       const ragvit_tensor *out, const ragvit_tensor *indices_out,
                                       const ragvit_tensor *x, const ragvit_tensor *keep,
                                       const ragvit_tensor *cu_seqlens) {
    TRY(tensor_check_ndim(op, "x", x, 3));
    TRY(tensor_check_float(op, "x", x));
    TRY(tensor_check_last_contiguous(op, "x", x));
    TRY(pack_check_keep(op, keep));
    const int64_t keep_shape[2] = {x->shape[0], x->shape[1]};
    TRY(tensor_check_shape(op, "keep", keep, 2, keep_shape));
    TRY(pack_check_cu_seqlens(op, cu_seqlens, x->shape[0], 0));
    const int64_t out_shape[2] = {-1, x->shape[2]};
    TRY(tensor_check_shape(op, "out", out, 2, out_shape));
    TRY(tensor_check_same_dtype(op, "out", out, "x", x));
    TRY(tensor_check_last_contiguous(op, "out", out));
    TRY(tensor_check_writable(op, "out", out));
    if (indices_out->is_present) {
        const int64_t indices_shape[1] = {out->shape[0]};
        TRY(tensor_check_shape(op, "indices", indices_out, 1, indices_shape));
        TRY(tensor_check_dtype(op, "indices", indices_out, RAGVIT_DTYPE_I32));
        TRY(tensor_check_writable(op, "indices", indices_out));
    }
    const char *const names[] = {"x", "keep", "cu_seqlens"};
    const ragvit_tensor *const ins[] = {x, keep, cu_seqlens};
    for (int i = 0; i < 3; i++) {
        TRY(tensor_check_no_alias(op, "out", out, names[i], ins[i]));
        TRY(tensor_check_no_alias(op, "indices", indices_out, names[i], ins[i]));
    }
    TRY(tensor_check_no_alias(op, "indices", indices_out, "out", out));
    a->out = out->data;
    a->indices_out = indices_out->is_present ? (int32_t *)indices_out->data : NULL;
    a->x = x->data;
    a->keep = (const uint8_t *)keep->data;
    a->cu_seqlens = (int32_t *)cu_seqlens->data;
    a->out_stride_token = out->strides[0];
    a->indices_stride = indices_out->is_present ? indices_out->strides[0] : 0;
    a->x_stride_b = x->strides[0];
    a->x_stride_n = x->strides[1];
    a->keep_stride_b = keep->strides[0];
    a->keep_stride_n = keep->strides[1];
    a->cu_seqlens_stride = cu_seqlens->strides[0];
    a->batch = x->shape[0];
    a->seqlen = x->shape[1];
    a->channels = x->shape[2];
    a->capacity = out->shape[0];
    a->elem_size = tensor_dtype_size(x->dtype);
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_pack_count(ragvit_context *ctx, const ragvit_tensor *cu_seqlens_out,
                                const ragvit_tensor *keep, void *stream) {
    static const char op[] = "pack";
    const char *const names[] = {"keep", "cu_seqlens"};
    const ragvit_tensor *const all[] = {keep, cu_seqlens_out};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    TRY(pack_count_check(op, &a, cu_seqlens_out, keep));
    TRY(tensor_check_devices(op, names, all, 2, &device_type, &device_id));
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_pack_count(&a);
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    TRY(ragvit_context_device(ctx, device_id, &dev));
    a.error_flag = dev->error_flag;
    TRY(ragvit_cuda_pack_count(&a, dev, stream));
    return pack_finish(ctx, device_id, stream, op);
#else
    (void)ctx;
    (void)stream;
    return pack_no_cuda(op);
#endif
}

/* Runs the optional count step and the gather step on validated args. */
static ragvit_status pack_run(const char *op, ragvit_context *ctx, const ragvit_pack_args *a,
                              int do_count, int32_t device_type, int32_t device_id, void *stream) {
    if (device_type == RAGVIT_DEVICE_CPU) {
        /* On the host a refused call writes no packed row: check capacity first. */
        if (do_count) TRY(ragvit_cpu_pack_count(a));
        int64_t total = a->cu_seqlens[a->batch * a->cu_seqlens_stride];
        if (total > a->capacity) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: out must have room for every kept token (capacity %" PRId64
                               "), got %" PRId64 " kept tokens",
                               op, a->capacity, total);
        }
        return ragvit_cpu_pack_gather(a);
    }
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    TRY(ragvit_context_device(ctx, device_id, &dev));
    ragvit_pack_args launch = *a;
    launch.error_flag = dev->error_flag;
    if (do_count) TRY(ragvit_cuda_pack_count(&launch, dev, stream));
    TRY(ragvit_cuda_pack_gather(&launch, dev, stream));
    return pack_finish(ctx, device_id, stream, op);
#else
    (void)ctx;
    (void)device_id;
    (void)stream;
    return pack_no_cuda(op);
#endif
}

ragvit_status ragvit_pack_gather(ragvit_context *ctx, const ragvit_tensor *out,
                                 const ragvit_tensor *indices_out, const ragvit_tensor *x,
                                 const ragvit_tensor *keep, const ragvit_tensor *cu_seqlens,
                                 void *stream) {
    static const char op[] = "pack";
    const char *const names[] = {"x", "keep", "cu_seqlens", "out", "indices"};
    const ragvit_tensor *const all[] = {x, keep, cu_seqlens, out, indices_out};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    TRY(pack_gather_check(op, &a, out, indices_out, x, keep, cu_seqlens));
    TRY(tensor_check_devices(op, names, all, 5, &device_type, &device_id));
    return pack_run(op, ctx, &a, 0, device_type, device_id, stream);
}

ragvit_status ragvit_pack_into(ragvit_context *ctx, const ragvit_tensor *out,
                               const ragvit_tensor *indices_out, const ragvit_tensor *cu_seqlens_out,
                               const ragvit_tensor *x, const ragvit_tensor *keep, void *stream) {
    static const char op[] = "pack_into";
    const char *const names[] = {"x", "keep", "out", "cu_seqlens", "indices"};
    const ragvit_tensor *const all[] = {x, keep, out, cu_seqlens_out, indices_out};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    TRY(pack_gather_check(op, &a, out, indices_out, x, keep, cu_seqlens_out));
    TRY(tensor_check_writable(op, "cu_seqlens", cu_seqlens_out));
    TRY(tensor_check_no_alias(op, "cu_seqlens", cu_seqlens_out, "x", x));
    TRY(tensor_check_no_alias(op, "cu_seqlens", cu_seqlens_out, "keep", keep));
    TRY(tensor_check_no_alias(op, "out", out, "cu_seqlens", cu_seqlens_out));
    TRY(tensor_check_no_alias(op, "indices", indices_out, "cu_seqlens", cu_seqlens_out));
    TRY(tensor_check_devices(op, names, all, 5, &device_type, &device_id));
    return pack_run(op, ctx, &a, 1, device_type, device_id, stream);
}

/* Host indices of the tokens inside sequences must lie in [0, N). */
static ragvit_status unpack_check_indices_host(const char *op, const ragvit_tensor *indices,
                                               const ragvit_tensor *cu_seqlens, int64_t n) {
    if (!indices->is_present) return RAGVIT_STATUS_OK;
    const int32_t *cu = (const int32_t *)cu_seqlens->data;
    const int32_t *idx = (const int32_t *)indices->data;
    int64_t num_seqs = cu_seqlens->shape[0] - 1, stride = cu_seqlens->strides[0];
    for (int64_t t = cu[0]; t < cu[num_seqs * stride]; t++) {
        int32_t value = idx[t * indices->strides[0]];
        if (value < 0 || value >= n) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: indices must lie in [0, N=%" PRId64 "), got %" PRId32
                               " at token %" PRId64,
                               op, n, value, t);
        }
    }
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_unpack_forward(ragvit_context *ctx, const ragvit_tensor *out,
                                    const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                    const ragvit_tensor *indices, double fill, void *stream) {
    static const char op[] = "unpack";
    const char *const names[] = {"packed", "cu_seqlens", "indices", "out"};
    const ragvit_tensor *const all[] = {packed, cu_seqlens, indices, out};
    int32_t device_type = 0, device_id = 0;
    TRY(tensor_check_ndim(op, "packed", packed, 2));
    TRY(tensor_check_float(op, "packed", packed));
    TRY(tensor_check_last_contiguous(op, "packed", packed));
    TRY(tensor_check_ndim(op, "cu_seqlens", cu_seqlens, 1));
    TRY(tensor_check_dtype(op, "cu_seqlens", cu_seqlens, RAGVIT_DTYPE_I32));
    if (cu_seqlens->shape[0] < 1) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: cu_seqlens must have num_seqs+1 >= 1 entries, got 0", op);
    }
    TRY(tensor_check_ndim(op, "out", out, 3));
    const int64_t out_shape[3] = {cu_seqlens->shape[0] - 1, out->shape[1], packed->shape[1]};
    TRY(tensor_check_shape(op, "out", out, 3, out_shape));
    TRY(tensor_check_same_dtype(op, "out", out, "packed", packed));
    TRY(tensor_check_last_contiguous(op, "out", out));
    TRY(tensor_check_writable(op, "out", out));
    if (indices->is_present) {
        const int64_t indices_shape[1] = {packed->shape[0]};
        TRY(tensor_check_shape(op, "indices", indices, 1, indices_shape));
        TRY(tensor_check_dtype(op, "indices", indices, RAGVIT_DTYPE_I32));
    }
    TRY(tensor_check_devices(op, names, all, 4, &device_type, &device_id));
    for (int i = 0; i < 3; i++) TRY(tensor_check_no_alias(op, "out", out, names[i], all[i]));
    if (device_type == RAGVIT_DEVICE_CPU) {
        TRY(tensor_check_cu_seqlens_host(op, cu_seqlens, packed->shape[0], out->shape[1], "N",
                                         NULL));
        TRY(unpack_check_indices_host(op, indices, cu_seqlens, out->shape[1]));
    }
    ragvit_unpack_args a = {
        .out = out->data,
        .packed = packed->data,
        .cu_seqlens = (const int32_t *)cu_seqlens->data,
        .indices = indices->is_present ? (const int32_t *)indices->data : NULL,
        .out_stride_b = out->strides[0],
        .out_stride_n = out->strides[1],
        .packed_stride_token = packed->strides[0],
        .cu_seqlens_stride = cu_seqlens->strides[0],
        .indices_stride = indices->is_present ? indices->strides[0] : 0,
        .batch = out->shape[0],
        .seqlen = out->shape[1],
        .channels = out->shape[2],
        .total_tokens = packed->shape[0],
        .fill = fill,
        .dtype = packed->dtype,
    };
    if (a.batch == 0 || a.seqlen == 0 || a.channels == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_unpack(&a);
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    TRY(ragvit_context_device(ctx, device_id, &dev));
    a.error_flag = dev->error_flag;
    TRY(ragvit_cuda_unpack(&a, dev, stream));
    return pack_finish(ctx, device_id, stream, op);
#else
    (void)ctx;
    (void)stream;
    return pack_no_cuda(op);
#endif
}
