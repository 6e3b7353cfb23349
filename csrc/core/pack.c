/* pack.c — host side of the pack family (pack, pack_into, repack, repack_into,
 * unpack, gather_prefix): validate, fill ragvit_pack_args / ragvit_unpack_args, hand
 * them to cpu/pack.c or kernels/pack.cu. Shapes: x (B, N, C) channels contiguous;
 * keep (B, N) (pack) or (T,) (repack) bool/uint8; packed (T or capacity, C);
 * cu_seqlens (B+1,) int32; indices / src (capacity,) int32. repack is pack with image
 * b read from rows [cu_seqlens[b], cu_seqlens[b+1]) of a packed tensor. Decision: the
 * eager forms count, then gather, so the host learns T in between; the _into forms
 * enqueue both as one CUDA launch (ragvit_cuda_pack_into): no host sync, no scratch.
 * So only the host can refuse a too-small capacity before writing (a count that
 * writes nothing comes first); on CUDA the launch flags it, having written the rows
 * that fit and the full counts (writing nothing would cost a second launch). */
#include <inttypes.h>
#include <math.h>

#include "core/dispatch.h"
#include "core/tensor.h"

static ragvit_status pack_check_keep(const char *op, const ragvit_tensor *keep, int32_t ndim) {
    RAGVIT_TRY(tensor_check_ndim(op, "keep", keep, ndim));
    if (keep->dtype != RAGVIT_DTYPE_BOOL && keep->dtype != RAGVIT_DTYPE_U8) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE, "%s: keep must be bool or uint8, got %s",
                           op, tensor_dtype_name(keep->dtype));
    }
    return RAGVIT_STATUS_OK;
}

static ragvit_status pack_check_cu_seqlens(const char *op, const ragvit_tensor *cu_seqlens,
                                           int64_t batch, int is_output) {
    const int64_t shape[1] = {batch + 1};
    RAGVIT_TRY(tensor_check_dtype(op, "cu_seqlens", cu_seqlens, RAGVIT_DTYPE_I32));
    RAGVIT_TRY(tensor_check_shape(op, "cu_seqlens", cu_seqlens, 1, shape));
    if (!is_output) return RAGVIT_STATUS_OK;
    RAGVIT_TRY(tensor_check_writable(op, "cu_seqlens", cu_seqlens));
    return tensor_check_no_self_overlap(op, "cu_seqlens", cu_seqlens);
}

/* The count part of a from keep (B, N) and cu_seqlens (B+1,), both validated. */
static void pack_fill_count(ragvit_pack_args *a, const ragvit_tensor *keep,
                            const ragvit_tensor *cu_seqlens) {
    a->keep = (const uint8_t *)keep->data;
    a->keep_stride_b = keep->strides[0];
    a->keep_stride_n = keep->strides[1];
    a->cu_seqlens = (int32_t *)cu_seqlens->data;
    a->cu_seqlens_stride = cu_seqlens->strides[0];
    a->batch = keep->shape[0];
    a->seqlen = keep->shape[1];
}

/* Validates keep + cu_seqlens_out and fills the count part of a. */
static ragvit_status pack_count_check(const char *op, ragvit_pack_args *a,
                                      const ragvit_tensor *cu_seqlens_out,
                                      const ragvit_tensor *keep) {
    RAGVIT_TRY(pack_check_keep(op, keep, 2));
    RAGVIT_TRY(pack_check_cu_seqlens(op, cu_seqlens_out, keep->shape[0], 1));
    RAGVIT_TRY(tensor_check_no_alias(op, "cu_seqlens", cu_seqlens_out, "keep", keep));
    pack_fill_count(a, keep, cu_seqlens_out);
    return RAGVIT_STATUS_OK;
}

/* Checks out (capacity, C) and the optional int32 index output against the
 * input x and the other inputs (no aliasing). */
static ragvit_status pack_check_outputs(const char *op, const char *x_name,
                                        const char *indices_name, const ragvit_tensor *out,
                                        const ragvit_tensor *indices_out, const ragvit_tensor *x,
                                        const ragvit_tensor *keep,
                                        const ragvit_tensor *cu_seqlens) {
    const int64_t out_shape[2] = {-1, x->shape[x->ndim - 1]};
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 2, out_shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "out", out, x_name, x));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out));
    if (indices_out->is_present) {
        const int64_t indices_shape[1] = {out->shape[0]};
        RAGVIT_TRY(tensor_check_shape(op, indices_name, indices_out, 1, indices_shape));
        RAGVIT_TRY(tensor_check_dtype(op, indices_name, indices_out, RAGVIT_DTYPE_I32));
        RAGVIT_TRY(tensor_check_writable(op, indices_name, indices_out));
        RAGVIT_TRY(tensor_check_no_self_overlap(op, indices_name, indices_out));
    }
    const char *const names[] = {x_name, "keep", "cu_seqlens"};
    const ragvit_tensor *const ins[] = {x, keep, cu_seqlens};
    RAGVIT_TRY(tensor_check_no_alias_any(op, "out", out, names, ins, 3));
    RAGVIT_TRY(tensor_check_no_alias_any(op, indices_name, indices_out, names, ins, 3));
    return tensor_check_no_alias(op, indices_name, indices_out, "out", out);
}

static void pack_fill_outputs(ragvit_pack_args *a, const ragvit_tensor *out,
                              const ragvit_tensor *indices_out, const ragvit_tensor *x) {
    a->out = out->data;
    a->indices_out = indices_out->is_present ? (int32_t *)indices_out->data : NULL;
    a->out_stride_token = out->strides[0];
    a->indices_stride = indices_out->is_present ? indices_out->strides[0] : 0;
    a->channels = x->shape[x->ndim - 1];
    a->capacity = out->shape[0];
    a->elem_size = tensor_dtype_size(x->dtype);
    a->dtype = x->dtype;
}

/* The cu_seqlens (B+1,) output of a count step: writable, aliasing no input
 * and no other output (out / indices_out may be absent: is_present 0). */
static ragvit_status pack_check_count_output(const char *op, const char *x_name,
                                             const char *indices_name, const char *cu_name,
                                             const ragvit_tensor *cu_seqlens_out,
                                             const ragvit_tensor *out,
                                             const ragvit_tensor *indices_out,
                                             const ragvit_tensor *x, const ragvit_tensor *keep) {
    RAGVIT_TRY(tensor_check_writable(op, cu_name, cu_seqlens_out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, cu_name, cu_seqlens_out));
    RAGVIT_TRY(tensor_check_no_alias(op, cu_name, cu_seqlens_out, x_name, x));
    RAGVIT_TRY(tensor_check_no_alias(op, cu_name, cu_seqlens_out, "keep", keep));
    RAGVIT_TRY(tensor_check_no_alias(op, "out", out, cu_name, cu_seqlens_out));
    return tensor_check_no_alias(op, indices_name, indices_out, cu_name, cu_seqlens_out);
}

/* Validates the gather arguments and fills the rest of a. */
static ragvit_status pack_gather_check(const char *op, ragvit_pack_args *a,
                                       const ragvit_tensor *out, const ragvit_tensor *indices_out,
                                       const ragvit_tensor *x, const ragvit_tensor *keep,
                                       const ragvit_tensor *cu_seqlens) {
    RAGVIT_TRY(tensor_check_ndim(op, "x", x, 3));
    RAGVIT_TRY(tensor_check_float(op, "x", x));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "x", x));
    RAGVIT_TRY(pack_check_keep(op, keep, 2));
    const int64_t keep_shape[2] = {x->shape[0], x->shape[1]};
    RAGVIT_TRY(tensor_check_shape(op, "keep", keep, 2, keep_shape));
    RAGVIT_TRY(pack_check_cu_seqlens(op, cu_seqlens, x->shape[0], 0));
    RAGVIT_TRY(pack_check_outputs(op, "x", "indices", out, indices_out, x, keep, cu_seqlens));
    pack_fill_count(a, keep, cu_seqlens);
    a->x = x->data;
    a->x_stride_b = x->strides[0];
    a->x_stride_n = x->strides[1];
    pack_fill_outputs(a, out, indices_out, x);
    return RAGVIT_STATUS_OK;
}

/* What pack_run does: the count alone (the eager forms' first call), the gather
 * alone (their second, cu_seqlens already written) or both (the _into forms; one
 * launch on CUDA). */
enum { PACK_COUNT = 1, PACK_GATHER = 2 };

/* Runs PACK_COUNT and/or PACK_GATHER on validated args. */
static ragvit_status pack_run(const char *op, ragvit_context *ctx, ragvit_pack_args *a, int steps,
                              int32_t device_type, int32_t device_id, void *stream) {
    if (device_type == RAGVIT_DEVICE_CPU) {
        /* On the host a refused call writes nothing: capacity is checked against a
         * count that writes nothing, before cu_seqlens or any row is written. */
        int64_t total = 0;
        if (steps == PACK_COUNT) return ragvit_cpu_pack_count(a);
        if (steps & PACK_COUNT)
            RAGVIT_TRY(ragvit_cpu_pack_total(a, &total));
        else
            total = a->cu_seqlens[a->batch * a->cu_seqlens_stride];
        if (total > a->capacity) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: out must have room for every kept token (capacity %" PRId64
                               "), got %" PRId64 " kept tokens",
                               op, a->capacity, total);
        }
        if (steps & PACK_COUNT) RAGVIT_TRY(ragvit_cpu_pack_count(a));
        return ragvit_cpu_pack_gather(a);
    }
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    a->error_flag = dev->error_flag;
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(steps == PACK_COUNT ? ragvit_cuda_pack_count(a, dev, stream)
                                      : steps == PACK_GATHER
                                          ? ragvit_cuda_pack_gather(a, dev, stream)
                                          : ragvit_cuda_pack_into(a, dev, stream)));
}

ragvit_status ragvit_pack_count(ragvit_context *ctx, const ragvit_tensor *cu_seqlens_out,
                                const ragvit_tensor *keep, void *stream) {
    static const char op[] = "pack";
    const char *const names[] = {"keep", "cu_seqlens"};
    const ragvit_tensor *const all[] = {keep, cu_seqlens_out};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    RAGVIT_TRY(pack_count_check(op, &a, cu_seqlens_out, keep));
    RAGVIT_TRY(tensor_check_devices(op, names, all, 2, &device_type, &device_id));
    return pack_run(op, ctx, &a, PACK_COUNT, device_type, device_id, stream);
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
    RAGVIT_TRY(pack_gather_check(op, &a, out, indices_out, x, keep, cu_seqlens));
    RAGVIT_TRY(tensor_check_devices(op, names, all, 5, &device_type, &device_id));
    return pack_run(op, ctx, &a, PACK_GATHER, device_type, device_id, stream);
}

ragvit_status ragvit_pack_into(ragvit_context *ctx, const ragvit_tensor *out,
                               const ragvit_tensor *indices_out,
                               const ragvit_tensor *cu_seqlens_out, const ragvit_tensor *x,
                               const ragvit_tensor *keep, void *stream) {
    static const char op[] = "pack_into";
    const char *const names[] = {"x", "keep", "out", "cu_seqlens", "indices"};
    const ragvit_tensor *const all[] = {x, keep, out, cu_seqlens_out, indices_out};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    RAGVIT_TRY(pack_gather_check(op, &a, out, indices_out, x, keep, cu_seqlens_out));
    RAGVIT_TRY(pack_check_count_output(op, "x", "indices", "cu_seqlens", cu_seqlens_out, out,
                                       indices_out, x, keep));
    RAGVIT_TRY(tensor_check_devices(op, names, all, 5, &device_type, &device_id));
    return pack_run(op, ctx, &a, PACK_COUNT | PACK_GATHER, device_type, device_id, stream);
}

/* Validates packed (T, C), cu_seqlens (B+1,) and keep (T,) and fills the
 * input part of a; on the host also the contents of cu_seqlens. */
static ragvit_status repack_check_inputs(const char *op, ragvit_pack_args *a,
                                         const ragvit_tensor *packed,
                                         const ragvit_tensor *cu_seqlens,
                                         const ragvit_tensor *keep) {
    RAGVIT_TRY(tensor_check_packed(op, packed, cu_seqlens));
    RAGVIT_TRY(pack_check_keep(op, keep, 1));
    const int64_t keep_shape[1] = {packed->shape[0]};
    RAGVIT_TRY(tensor_check_shape(op, "keep", keep, 1, keep_shape));
    if (packed->shape[0] > INT32_MAX) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: packed must have at most 2^31-1 rows for int32 src, got %" PRId64,
                           op, packed->shape[0]);
    }
    a->x = packed->data;
    a->keep = (const uint8_t *)keep->data;
    a->cu_seqlens_in = (const int32_t *)cu_seqlens->data;
    a->cu_seqlens_in_stride = cu_seqlens->strides[0];
    a->x_stride_b = 0;
    a->x_stride_n = packed->strides[0];
    a->keep_stride_b = 0;
    a->keep_stride_n = keep->strides[0];
    a->batch = cu_seqlens->shape[0] - 1;
    a->seqlen = packed->shape[0];
    a->channels = packed->shape[1];
    a->elem_size = tensor_dtype_size(packed->dtype);
    return RAGVIT_STATUS_OK;
}

/* One repack entry: count (cu_seqlens_out, no out), gather (out, cu_seqlens_out
 * read) or both (into). Host cu_seqlens contents are checked before any write. */
static ragvit_status repack_run(const char *op, ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *src_out, const ragvit_tensor *cu_seqlens_out,
                                const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                const ragvit_tensor *keep, const ragvit_tensor *fuse_weights,
                                int do_count, void *stream) {
    const char *const names[] = {"packed", "cu_seqlens",     "keep",        "out",
                                 "src",    "cu_seqlens_out", "fuse_weights"};
    const ragvit_tensor *const all[] = {packed,  cu_seqlens,     keep,        out,
                                        src_out, cu_seqlens_out, fuse_weights};
    int32_t device_type = 0, device_id = 0;
    ragvit_pack_args a = {0};
    RAGVIT_TRY(repack_check_inputs(op, &a, packed, cu_seqlens, keep));
    if (fuse_weights->is_present) {
        const int64_t weights_shape[1] = {packed->shape[0]};
        RAGVIT_TRY(tensor_check_shape(op, "fuse_weights", fuse_weights, 1, weights_shape));
        RAGVIT_TRY(tensor_check_dtype(op, "fuse_weights", fuse_weights, RAGVIT_DTYPE_F32));
        RAGVIT_TRY(tensor_check_no_alias(op, "out", out, "fuse_weights", fuse_weights));
        RAGVIT_TRY(tensor_check_no_alias(op, "src", src_out, "fuse_weights", fuse_weights));
        RAGVIT_TRY(tensor_check_no_alias(op, "cu_seqlens_out", cu_seqlens_out, "fuse_weights",
                                         fuse_weights));
        a.fuse_weights = (const float *)fuse_weights->data;
        a.fuse_weights_stride = fuse_weights->strides[0];
        a.is_fusing = 1;
        /* The kept rows plus one fused token per sequence are counted into int32
         * cu_seqlens_out: their largest possible total must fit before anything runs. */
        if (packed->shape[0] + a.batch > INT32_MAX) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                               "%s: packed rows plus one fused token per sequence must be at "
                               "most 2^31-1 for int32 cu_seqlens_out, got %" PRId64
                               " rows and %" PRId64 " sequences",
                               op, packed->shape[0], a.batch);
        }
    }
    const int64_t shape[1] = {cu_seqlens->shape[0]};
    RAGVIT_TRY(tensor_check_dtype(op, "cu_seqlens_out", cu_seqlens_out, RAGVIT_DTYPE_I32));
    RAGVIT_TRY(tensor_check_shape(op, "cu_seqlens_out", cu_seqlens_out, 1, shape));
    RAGVIT_TRY(
        tensor_check_no_alias(op, "cu_seqlens_out", cu_seqlens_out, "cu_seqlens", cu_seqlens));
    if (out->is_present) {
        RAGVIT_TRY(pack_check_outputs(op, "packed", "src", out, src_out, packed, keep, cu_seqlens));
        pack_fill_outputs(&a, out, src_out, packed);
    }
    if (do_count) {
        RAGVIT_TRY(pack_check_count_output(op, "packed", "src", "cu_seqlens_out", cu_seqlens_out,
                                           out, src_out, packed, keep));
    } else {
        RAGVIT_TRY(tensor_check_no_alias(op, "out", out, "cu_seqlens_out", cu_seqlens_out));
        RAGVIT_TRY(tensor_check_no_alias(op, "src", src_out, "cu_seqlens_out", cu_seqlens_out));
    }
    a.cu_seqlens = (int32_t *)cu_seqlens_out->data;
    a.cu_seqlens_stride = cu_seqlens_out->strides[0];
    RAGVIT_TRY(tensor_check_devices(op, names, all, 7, &device_type, &device_id));
    if (device_type == RAGVIT_DEVICE_CPU) {
        RAGVIT_TRY(tensor_check_cu_seqlens_host(op, cu_seqlens, packed->shape[0], -1, NULL, NULL));
    }
    const int steps = (do_count ? PACK_COUNT : 0) | (out->is_present ? PACK_GATHER : 0);
    return pack_run(op, ctx, &a, steps, device_type, device_id, stream);
}

ragvit_status ragvit_repack_count(ragvit_context *ctx, const ragvit_tensor *cu_seqlens_out,
                                  const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                  const ragvit_tensor *keep, const ragvit_tensor *fuse_weights,
                                  void *stream) {
    const ragvit_tensor absent = {0};
    return repack_run("repack", ctx, &absent, &absent, cu_seqlens_out, packed, cu_seqlens, keep,
                      fuse_weights, 1, stream);
}

ragvit_status ragvit_repack_gather(ragvit_context *ctx, const ragvit_tensor *out,
                                   const ragvit_tensor *src_out, const ragvit_tensor *packed,
                                   const ragvit_tensor *cu_seqlens, const ragvit_tensor *keep,
                                   const ragvit_tensor *fuse_weights,
                                   const ragvit_tensor *cu_seqlens_out, void *stream) {
    return repack_run("repack", ctx, out, src_out, cu_seqlens_out, packed, cu_seqlens, keep,
                      fuse_weights, 0, stream);
}

ragvit_status ragvit_repack_into(ragvit_context *ctx, const ragvit_tensor *out,
                                 const ragvit_tensor *src_out, const ragvit_tensor *cu_seqlens_out,
                                 const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                 const ragvit_tensor *keep, const ragvit_tensor *fuse_weights,
                                 void *stream) {
    return repack_run("repack_into", ctx, out, src_out, cu_seqlens_out, packed, cu_seqlens, keep,
                      fuse_weights, 1, stream);
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

/* Host lengths of gather_prefix: every sequence must hold at least k tokens. */
static ragvit_status prefix_check_lengths_host(const char *op, const ragvit_tensor *cu_seqlens,
                                               int64_t k) {
    const int32_t *cu = (const int32_t *)cu_seqlens->data;
    const int64_t num_seqs = cu_seqlens->shape[0] - 1, stride = cu_seqlens->strides[0];
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = (int64_t)cu[(s + 1) * stride] - cu[s * stride];
        if (len < k) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: every sequence must have at least k=%" PRId64
                               " tokens, got length %" PRId64 " for sequence %" PRId64,
                               op, k, len, s);
        }
    }
    return RAGVIT_STATUS_OK;
}

/* The smallest magnitude that rounds to inf in dtype (round to nearest even): a
 * finite fill at or past it would be written as inf. */
static double unpack_fill_limit(int32_t dtype) {
    if (dtype == RAGVIT_DTYPE_F16) return 65520.0;     /* 65504 + half an ulp */
    if (dtype == RAGVIT_DTYPE_BF16) return 0x1.ffp127; /* 2^128 - 2^119 */
    return 0x1.ffffffp127;                             /* FLT_MAX + half an ulp */
}

/* unpack and gather_prefix (is_prefix): out (B, N or k, C) from packed rows. */
static ragvit_status unpack_run(const char *op, ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                const ragvit_tensor *indices, double fill, int is_prefix,
                                void *stream) {
    const char *const names[] = {"packed", "cu_seqlens", "indices", "out"};
    const ragvit_tensor *const all[] = {packed, cu_seqlens, indices, out};
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_packed(op, packed, cu_seqlens));
    RAGVIT_TRY(tensor_check_ndim(op, "out", out, 3));
    const int64_t out_shape[3] = {cu_seqlens->shape[0] - 1, out->shape[1], packed->shape[1]};
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 3, out_shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "out", out, "packed", packed));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out));
    if (indices->is_present) {
        const int64_t indices_shape[1] = {packed->shape[0]};
        RAGVIT_TRY(tensor_check_shape(op, "indices", indices, 1, indices_shape));
        RAGVIT_TRY(tensor_check_dtype(op, "indices", indices, RAGVIT_DTYPE_I32));
    }
    if (isfinite(fill) && fabs(fill) >= unpack_fill_limit(packed->dtype)) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: fill must be finite in %s when it is finite (|fill| < %g), got %g",
                           op, tensor_dtype_name(packed->dtype), unpack_fill_limit(packed->dtype),
                           fill);
    }
    RAGVIT_TRY(tensor_check_devices(op, names, all, 4, &device_type, &device_id));
    RAGVIT_TRY(tensor_check_no_alias_any(op, "out", out, names, all, 3));
    if (device_type == RAGVIT_DEVICE_CPU) {
        RAGVIT_TRY(tensor_check_cu_seqlens_host(op, cu_seqlens, packed->shape[0],
                                                is_prefix ? -1 : out->shape[1], "N", NULL));
        RAGVIT_TRY(unpack_check_indices_host(op, indices, cu_seqlens, out->shape[1]));
        if (is_prefix) RAGVIT_TRY(prefix_check_lengths_host(op, cu_seqlens, out->shape[1]));
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
        .is_prefix = is_prefix,
    };
    if (a.batch == 0 || a.seqlen == 0 || a.channels == 0) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_unpack(&a);
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    a.error_flag = dev->error_flag;
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_unpack(&a, dev, stream)));
}

ragvit_status ragvit_unpack(ragvit_context *ctx, const ragvit_tensor *out,
                            const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                            const ragvit_tensor *indices, double fill, void *stream) {
    return unpack_run("unpack", ctx, out, packed, cu_seqlens, indices, fill, 0, stream);
}

ragvit_status ragvit_gather_prefix(ragvit_context *ctx, const ragvit_tensor *out,
                                   const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                   void *stream) {
    const ragvit_tensor absent = {0};
    return unpack_run("gather_prefix", ctx, out, packed, cu_seqlens, &absent, 0.0, 1, stream);
}
