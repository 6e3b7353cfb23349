/* bind_pack.c — the pack family of ragvit._C, on packed tokens (T, C) with
 * cu_seqlens (B+1,) int32: pack and pack_into (padded (B, N, C) + keep (B, N) ->
 * packed), unpack (-> (B, N, C)), gather_prefix ((B, k, C)) and segment_mean
 * ((B, C)), repack and repack_into (packed -> packed, for later pruning stages).
 * Decision: pack and repack size their outputs from the device total (one host
 * sync); the _into forms write caller-sized buffers, so they never allocate. */
#include "glue.h"

/* -1 with ValueError unless packed is (T, C) and cu_seqlens (B+1,) (for
 * sizing an output before the core checks everything else). */
static int check_packed_dims(call_state *cs, const ragvit_tensor *packed, const ragvit_tensor *cu) {
    if (packed->ndim == 2 && cu->ndim == 1) return 0;
    return raise_failure(
        ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                    "%s: packed must be (T, C) and cu_seqlens (B+1,), got %d and %d dimensions",
                    cs->op, packed->ndim, cu->ndim));
}

/* The output of a per-sequence op: (B, rows, C), or (B, C) when rows < 0.
 * Returns a new reference to `given` (its rows per sequence checked) or a new
 * array allocated like packed; NULL with an exception. */
static PyObject *sequence_output(call_state *cs, PyObject *given, const ragvit_tensor *packed,
                                 const ragvit_tensor *cu, long long rows, const char *rows_name,
                                 ragvit_tensor *out) {
    if (given != NULL) {
        if (rows >= 0 && out->ndim == 3 && out->shape[1] != rows) {
            raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                      "%s: out must have %s=%lld rows per sequence, got %lld",
                                      cs->op, rows_name, rows, (long long)out->shape[1]));
            return NULL;
        }
        Py_INCREF(given);
        return given;
    }
    if (check_packed_dims(cs, packed, cu)) return NULL;
    const int64_t batch = cu->shape[0] > 0 ? cu->shape[0] - 1 : 0;
    const int64_t shape[3] = {batch, rows >= 0 ? rows : packed->shape[1], packed->shape[1]};
    return alloc_like(cs, 0, packed, "out", packed->dtype, rows >= 0 ? 3 : 2, shape, out);
}

PyObject *py_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "keep", "stream"};
    PyObject *values[3];
    PyObject *cu_obj = NULL, *out_obj = NULL, *idx_obj = NULL, *result = NULL;
    ragvit_tensor x, keep, cu, out, idx;
    call_state cs;
    call_init(&cs, module, "pack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 3, 2, 2, values)) return NULL;
    if (parse_stream(&cs, values[2])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "keep", &keep)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    if (x.ndim != 3) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "pack: x must have 3 dimensions (B, N, C), got %d", x.ndim));
    }
    const int64_t cu_shape[1] = {x.shape[0] + 1};
    cu_obj = alloc_like(&cs, 0, &x, "cu_seqlens", RAGVIT_DTYPE_I32, 1, cu_shape, &cu);
    if (cu_obj == NULL) goto done;
    RAISE_IF(ragvit_pack_count(&cs.st->ctx, &cu, &keep, cs.stream));
    int32_t total = 0;
    RAISE_IF(ragvit_read_int32(&total, &cu, x.shape[0], cs.stream));
    const int64_t out_shape[2] = {total, x.shape[2]};
    const int64_t idx_shape[1] = {total};
    out_obj = alloc_like(&cs, 0, &x, "packed", x.dtype, 2, out_shape, &out);
    if (out_obj == NULL) goto done;
    idx_obj = alloc_like(&cs, 0, &x, "indices", RAGVIT_DTYPE_I32, 1, idx_shape, &idx);
    if (idx_obj == NULL) goto done;
    RAISE_IF(ragvit_pack_gather(&cs.st->ctx, &out, &idx, &x, &keep, &cu, cs.stream));
    result = PyTuple_Pack(3, out_obj, cu_obj, idx_obj);
done:
    release_slots(&cs);
    Py_XDECREF(cu_obj);
    Py_XDECREF(out_obj);
    Py_XDECREF(idx_obj);
    return result;
}

PyObject *py_pack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames) {
    static const char *const names[] = {"x", "keep", "out", "cu_seqlens", "indices", "stream"};
    PyObject *values[6];
    PyObject *result = NULL;
    ragvit_tensor x, keep, out, cu, idx;
    call_state cs;
    call_init(&cs, module, "pack_into");
    if (parse_args(cs.op, args, nargs, kwnames, names, 6, 4, 4, values)) return NULL;
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "keep", &keep) ||
        import_arg(&cs, values[2], "out", &out) || import_arg(&cs, values[3], "cu_seqlens", &cu) ||
        import_arg(&cs, values[4], "indices", &idx)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_pack_into(&cs.st->ctx, &out, &idx, &cu, &x, &keep, cs.stream));
    result = Py_None;
    Py_INCREF(result);
done:
    release_slots(&cs);
    return result;
}

PyObject *py_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"packed", "cu_seqlens", "N",     "indices",
                                        "fill",   "out",        "stream"};
    PyObject *values[7];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, idx, out;
    double fill;
    call_state cs;
    call_init(&cs, module, "unpack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 7, 3, 3, values)) return NULL;
    long long n = 0;
    if (parse_count(&cs, values[2], "N", &n)) return NULL;
    if (parse_float(&cs, values[4], "fill", 0.0, &fill)) return NULL;
    if (parse_stream(&cs, values[6])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[3], "indices", &idx) || import_arg(&cs, values[5], "out", &out)) {
        goto done;
    }
    out_obj = sequence_output(&cs, values[5], &packed, &cu, n, "N", &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_unpack(&cs.st->ctx, &out, &packed, &cu, &idx, fill, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

/* gather_prefix (is_prefix: required k) and segment_mean (optional skip):
 * (packed, cu_seqlens, <count>, *, out=None, stream=None) -> out. */
static PyObject *sequence_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, const char *op, const char *count_name,
                             int is_prefix) {
    const char *const names[] = {"packed", "cu_seqlens", count_name, "out", "stream"};
    const int positional = is_prefix ? 3 : 2;
    PyObject *values[5];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, out;
    long long count = 0;
    call_state cs;
    call_init(&cs, module, op);
    if (parse_args(op, args, nargs, kwnames, names, 5, positional, positional, values)) {
        return NULL;
    }
    if (values[2] != NULL && parse_count(&cs, values[2], count_name, &count)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) || import_arg(&cs, values[3], "out", &out)) {
        goto done;
    }
    out_obj =
        sequence_output(&cs, values[3], &packed, &cu, is_prefix ? count : -1, count_name, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(is_prefix ? ragvit_gather_prefix(&cs.st->ctx, &out, &packed, &cu, cs.stream)
                       : ragvit_segment_mean(&cs.st->ctx, &out, &packed, &cu, count, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

PyObject *py_gather_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    return sequence_op(module, args, nargs, kwnames, "gather_prefix", "k", 1);
}

PyObject *py_segment_mean(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    return sequence_op(module, args, nargs, kwnames, "segment_mean", "skip", 0);
}

PyObject *py_repack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"packed", "cu_seqlens", "keep", "fuse_weights", "stream"};
    PyObject *values[5];
    PyObject *cu2_obj = NULL, *out_obj = NULL, *src_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, keep, weights, cu2, out, src;
    call_state cs;
    call_init(&cs, module, "repack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 5, 3, 3, values)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[2], "keep", &keep) ||
        import_arg(&cs, values[3], "fuse_weights", &weights)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    if (check_packed_dims(&cs, &packed, &cu)) goto done;
    cu2_obj = alloc_like(&cs, 0, &packed, "cu_seqlens", RAGVIT_DTYPE_I32, 1, cu.shape, &cu2);
    if (cu2_obj == NULL) goto done;
    RAISE_IF(ragvit_repack_count(&cs.st->ctx, &cu2, &packed, &cu, &keep, &weights, cs.stream));
    int32_t total = 0;
    RAISE_IF(ragvit_read_int32(&total, &cu2, cu.shape[0] - 1, cs.stream));
    const int64_t out_shape[2] = {total, packed.shape[1]};
    const int64_t src_shape[1] = {total};
    out_obj = alloc_like(&cs, 0, &packed, "packed", packed.dtype, 2, out_shape, &out);
    if (out_obj == NULL) goto done;
    src_obj = alloc_like(&cs, 0, &packed, "src", RAGVIT_DTYPE_I32, 1, src_shape, &src);
    if (src_obj == NULL) goto done;
    RAISE_IF(ragvit_repack_gather(&cs.st->ctx, &out, &src, &packed, &cu, &keep, &weights, &cu2,
                                  cs.stream));
    result = PyTuple_Pack(3, out_obj, cu2_obj, src_obj);
done:
    release_slots(&cs);
    Py_XDECREF(cu2_obj);
    Py_XDECREF(out_obj);
    Py_XDECREF(src_obj);
    return result;
}

PyObject *py_repack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    static const char *const names[] = {"packed",         "cu_seqlens", "keep",         "out",
                                        "cu_seqlens_out", "src",        "fuse_weights", "stream"};
    PyObject *values[8];
    PyObject *result = NULL;
    ragvit_tensor packed, cu, keep, out, cu2, src, weights;
    call_state cs;
    call_init(&cs, module, "repack_into");
    if (parse_args(cs.op, args, nargs, kwnames, names, 8, 5, 5, values)) return NULL;
    if (parse_stream(&cs, values[7])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[2], "keep", &keep) || import_arg(&cs, values[3], "out", &out) ||
        import_arg(&cs, values[4], "cu_seqlens_out", &cu2) ||
        import_arg(&cs, values[5], "src", &src) ||
        import_arg(&cs, values[6], "fuse_weights", &weights)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_repack_into(&cs.st->ctx, &out, &src, &cu2, &packed, &cu, &keep, &weights,
                                cs.stream));
    result = Py_None;
    Py_INCREF(result);
done:
    release_slots(&cs);
    return result;
}
