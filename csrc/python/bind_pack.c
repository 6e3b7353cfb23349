/* bind_pack.c — the pack family of ragvit._C, on packed tokens (T, C) with
 * cu_seqlens (B+1,) int32: pack and pack_into (padded (B, N, C) + keep (B, N) ->
 * packed), unpack (-> (B, N, C)), gather_prefix ((B, k, C)) and segment_mean
 * ((B, C)), repack and repack_into (packed -> packed, for later pruning stages).
 * Decision: pack and repack size their outputs from the device total (one host
 * sync); the _into forms write caller-sized buffers, so they never allocate. */
#include "glue.h"

/* What pack and repack return: (packed, cu_seqlens, index). */
enum { RESULT_PACKED, RESULT_CU_SEQLENS, RESULT_INDEX, RESULT_COUNT };

/* -1 with ValueError unless packed is (T, C) and cu_seqlens (B+1,) (for
 * sizing an output before the core checks everything else). */
static int check_packed_dims(call_state *cs, const ragvit_tensor *packed, const ragvit_tensor *cu) {
    if (packed->ndim == 2 && cu->ndim == 1) return 0;
    return raise_failure(
        ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                    "%s: packed must be (T, C) and cu_seqlens (B+1,), got %d and %d dimensions",
                    cs->op, packed->ndim, cu->ndim));
}

/* pack and repack between their count and their gather: reads the total T at
 * cu_seqlens[last] (one host sync on CUDA), then allocates the (T, channels)
 * rows and the (T,) int32 index like slot 0, into objs[] (owned) and views[]. */
static int alloc_gathered(call_state *cs, const ragvit_tensor *like, int64_t last, int64_t channels,
                          const char *index_name, PyObject **objs, ragvit_tensor *views) {
    int32_t total = 0;
    if (raise_status(ragvit_read_int32(&total, &views[RESULT_CU_SEQLENS], last, cs->stream))) {
        return -1;
    }
    const int64_t rows_shape[2] = {total, channels};
    const int64_t index_shape[1] = {total};
    objs[RESULT_PACKED] =
        alloc_like(cs, like, "packed", like->dtype, 2, rows_shape, &views[RESULT_PACKED]);
    if (objs[RESULT_PACKED] == NULL) return -1;
    objs[RESULT_INDEX] =
        alloc_like(cs, like, index_name, RAGVIT_DTYPE_I32, 1, index_shape, &views[RESULT_INDEX]);
    return objs[RESULT_INDEX] == NULL ? -1 : 0;
}

/* The exit of pack and repack: the tuple when rc is 0, each output in the caller's
 * array type; objs are dropped either way. */
static PyObject *end_gathered(call_state *cs, PyObject **objs, int rc) {
    if (mark_buffers(cs, objs, RESULT_COUNT) < 0 && rc == 0) rc = -1;
    release_slots(cs);
    for (int i = 0; i < RESULT_COUNT && rc == 0 && cs->wrap_arg != NULL; i++) {
        objs[i] = wrap_output(cs, objs[i]); /* steals objs[i] */
        if (objs[i] == NULL) rc = -1;
    }
    PyObject *result =
        rc == 0 ? PyTuple_Pack(3, objs[RESULT_PACKED], objs[RESULT_CU_SEQLENS], objs[RESULT_INDEX])
                : NULL;
    for (int i = 0; i < RESULT_COUNT; i++) Py_XDECREF(objs[i]);
    return result;
}

PyObject *py_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    enum { X, KEEP, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"x", "keep", "stream"};
    static const op_signature sig = SIGNATURE("pack", names, 2, 2, ARG_BIT(X) | ARG_BIT(KEEP), 0);
    PyObject *values[NUM_ARGS], *objs[RESULT_COUNT] = {NULL, NULL, NULL};
    ragvit_tensor t[NUM_ARGS], views[RESULT_COUNT];
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        call_import(&cs, values, t) || finish_streams(&cs)) {
        goto done;
    }
    if (t[X].ndim != 3) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "pack: x must have 3 dimensions (B, N, C), got %d", t[X].ndim));
    }
    /* cu_seqlens is sized from x: a keep of another batch is named here, before
     * the count would refuse the caller-invisible cu_seqlens instead. */
    if (t[KEEP].ndim == 2 && t[KEEP].shape[0] != t[X].shape[0]) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "pack: keep must have shape (%lld, %lld), got (%lld, %lld)",
                             (long long)t[X].shape[0], (long long)t[X].shape[1],
                             (long long)t[KEEP].shape[0], (long long)t[KEEP].shape[1]));
    }
    const int64_t cu_shape[1] = {t[X].shape[0] + 1};
    objs[RESULT_CU_SEQLENS] = alloc_like(&cs, &t[X], "cu_seqlens", RAGVIT_DTYPE_I32, 1, cu_shape,
                                         &views[RESULT_CU_SEQLENS]);
    if (objs[RESULT_CU_SEQLENS] == NULL) goto done;
    RAISE_IF(ragvit_pack_count(&cs.st->ctx, &views[RESULT_CU_SEQLENS], &t[KEEP], cs.stream));
    if (alloc_gathered(&cs, &t[X], t[X].shape[0], t[X].shape[2], "indices", objs, views)) {
        goto done;
    }
    CORE_CALL(&cs, rc,
              ragvit_pack_gather(&cs.st->ctx, &views[RESULT_PACKED], &views[RESULT_INDEX], &t[X],
                                 &t[KEEP], &views[RESULT_CU_SEQLENS], cs.stream));
done:
    return end_gathered(&cs, objs, rc);
}

PyObject *py_pack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames) {
    enum { X, KEEP, OUT, CU_SEQLENS, INDICES, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"x",          "keep",    "out",
                                                "cu_seqlens", "indices", "stream"};
    static const op_signature sig = SIGNATURE(
        "pack_into", names, 4, 4,
        ARG_BIT(X) | ARG_BIT(KEEP) | ARG_BIT(OUT) | ARG_BIT(CU_SEQLENS) | ARG_BIT(INDICES),
        ARG_BIT(OUT) | ARG_BIT(CU_SEQLENS) | ARG_BIT(INDICES));
    PyObject *values[NUM_ARGS];
    ragvit_tensor t[NUM_ARGS];
    call_state cs;
    int rc = call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
             call_import(&cs, values, t) || finish_streams(&cs);
    if (rc == 0) {
        CORE_CALL(&cs, rc,
                  ragvit_pack_into(&cs.st->ctx, &t[OUT], &t[INDICES], &t[CU_SEQLENS], &t[X],
                                   &t[KEEP], cs.stream));
    }
    return call_end(&cs, rc ? NULL : Py_NewRef(Py_None), rc);
}

/* The output of a per-sequence op: (B, rows, C), or (B, C) when rows < 0.
 * *out_obj: a new reference to `given` (its rows per sequence checked) or a
 * new array allocated like packed. */
static int sequence_output(call_state *cs, PyObject *given, const ragvit_tensor *packed,
                           const ragvit_tensor *cu, long long rows, const char *rows_name,
                           ragvit_tensor *out, PyObject **out_obj) {
    if (given != NULL) {
        if (rows >= 0 && out->ndim == 3 && out->shape[1] != rows) {
            return raise_failure(
                ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                            "%s: out must have %s=%lld rows per sequence, got %lld", cs->op,
                            rows_name, rows, (long long)out->shape[1]));
        }
        *out_obj = Py_NewRef(given);
        return 0;
    }
    if (check_packed_dims(cs, packed, cu)) return -1;
    const int64_t batch = cu->shape[0] > 0 ? cu->shape[0] - 1 : 0;
    const int64_t shape[3] = {batch, rows >= 0 ? rows : packed->shape[1], packed->shape[1]};
    *out_obj = alloc_like(cs, packed, "out", packed->dtype, rows >= 0 ? 3 : 2, shape, out);
    return *out_obj == NULL ? -1 : 0;
}

PyObject *py_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    enum { PACKED, CU_SEQLENS, N, INDICES, FILL, OUT, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"packed", "cu_seqlens", "N",     "indices",
                                                "fill",   "out",        "stream"};
    static const op_signature sig = SIGNATURE(
        "unpack", names, 3, 3,
        ARG_BIT(PACKED) | ARG_BIT(CU_SEQLENS) | ARG_BIT(INDICES) | ARG_BIT(OUT), ARG_BIT(OUT));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    long long n = 0;
    double fill;
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        parse_count(&cs, values, N, &n) || parse_float(&cs, values, FILL, 0.0, &fill) ||
        call_import(&cs, values, t) ||
        sequence_output(&cs, values[OUT], &t[PACKED], &t[CU_SEQLENS], n, names[N], &t[OUT],
                        &out_obj)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc,
              ragvit_unpack(&cs.st->ctx, &t[OUT], &t[PACKED], &t[CU_SEQLENS], &t[INDICES], fill,
                            cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}

/* gather_prefix (required k) and segment_mean (optional skip):
 * (packed, cu_seqlens, <count>, *, out=None, stream=None) -> out. */
enum { SEQ_PACKED, SEQ_CU_SEQLENS, SEQ_COUNT, SEQ_OUT, SEQ_STREAM, SEQ_NUM_ARGS };
enum { SEQ_ARRAYS = ARG_BIT(SEQ_PACKED) | ARG_BIT(SEQ_CU_SEQLENS) | ARG_BIT(SEQ_OUT) };

static PyObject *sequence_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, const op_signature *sig, int is_prefix) {
    PyObject *values[SEQ_NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[SEQ_NUM_ARGS];
    long long count = 0;
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, sig, args, nargs, kwnames, values) ||
        parse_count(&cs, values, SEQ_COUNT, &count) || call_import(&cs, values, t) ||
        sequence_output(&cs, values[SEQ_OUT], &t[SEQ_PACKED], &t[SEQ_CU_SEQLENS],
                        is_prefix ? count : -1, sig->names[SEQ_COUNT], &t[SEQ_OUT], &out_obj)) {
        goto done;
    }
    const ragvit_tensor *out = &t[SEQ_OUT], *packed = &t[SEQ_PACKED], *cu = &t[SEQ_CU_SEQLENS];
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc,
              is_prefix ? ragvit_gather_prefix(&cs.st->ctx, out, packed, cu, cs.stream)
                        : ragvit_segment_mean(&cs.st->ctx, out, packed, cu, count, cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}

PyObject *py_gather_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[SEQ_NUM_ARGS] = {"packed", "cu_seqlens", "k", "out", "stream"};
    static const op_signature sig =
        SIGNATURE("gather_prefix", names, 3, 3, SEQ_ARRAYS, ARG_BIT(SEQ_OUT));
    return sequence_op(module, args, nargs, kwnames, &sig, 1);
}

PyObject *py_segment_mean(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    static const char *const names[SEQ_NUM_ARGS] = {"packed", "cu_seqlens", "skip", "out",
                                                    "stream"};
    static const op_signature sig =
        SIGNATURE("segment_mean", names, 2, 2, SEQ_ARRAYS, ARG_BIT(SEQ_OUT));
    return sequence_op(module, args, nargs, kwnames, &sig, 0);
}

PyObject *py_repack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    enum { PACKED, CU_SEQLENS, KEEP, FUSE_WEIGHTS, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"packed", "cu_seqlens", "keep", "fuse_weights",
                                                "stream"};
    static const op_signature sig =
        SIGNATURE("repack", names, 3, 3,
                  ARG_BIT(PACKED) | ARG_BIT(CU_SEQLENS) | ARG_BIT(KEEP) | ARG_BIT(FUSE_WEIGHTS), 0);
    PyObject *values[NUM_ARGS], *objs[RESULT_COUNT] = {NULL, NULL, NULL};
    ragvit_tensor t[NUM_ARGS], views[RESULT_COUNT];
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        call_import(&cs, values, t) || finish_streams(&cs) ||
        check_packed_dims(&cs, &t[PACKED], &t[CU_SEQLENS])) {
        goto done;
    }
    objs[RESULT_CU_SEQLENS] = alloc_like(&cs, &t[PACKED], "cu_seqlens", RAGVIT_DTYPE_I32, 1,
                                         t[CU_SEQLENS].shape, &views[RESULT_CU_SEQLENS]);
    if (objs[RESULT_CU_SEQLENS] == NULL) goto done;
    RAISE_IF(ragvit_repack_count(&cs.st->ctx, &views[RESULT_CU_SEQLENS], &t[PACKED], &t[CU_SEQLENS],
                                 &t[KEEP], &t[FUSE_WEIGHTS], cs.stream));
    if (alloc_gathered(&cs, &t[PACKED], t[CU_SEQLENS].shape[0] - 1, t[PACKED].shape[1], "src", objs,
                       views)) {
        goto done;
    }
    CORE_CALL(&cs, rc,
              ragvit_repack_gather(&cs.st->ctx, &views[RESULT_PACKED], &views[RESULT_INDEX],
                                   &t[PACKED], &t[CU_SEQLENS], &t[KEEP], &t[FUSE_WEIGHTS],
                                   &views[RESULT_CU_SEQLENS], cs.stream));
done:
    return end_gathered(&cs, objs, rc);
}

PyObject *py_repack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    enum { PACKED, CU_SEQLENS, KEEP, OUT, CU_SEQLENS_OUT, SRC, FUSE_WEIGHTS, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {
        "packed", "cu_seqlens", "keep", "out", "cu_seqlens_out", "src", "fuse_weights", "stream"};
    static const op_signature sig =
        SIGNATURE("repack_into", names, 5, 5,
                  ARG_BIT(PACKED) | ARG_BIT(CU_SEQLENS) | ARG_BIT(KEEP) | ARG_BIT(OUT) |
                      ARG_BIT(CU_SEQLENS_OUT) | ARG_BIT(SRC) | ARG_BIT(FUSE_WEIGHTS),
                  ARG_BIT(OUT) | ARG_BIT(CU_SEQLENS_OUT) | ARG_BIT(SRC));
    PyObject *values[NUM_ARGS];
    ragvit_tensor t[NUM_ARGS];
    call_state cs;
    int rc = call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
             call_import(&cs, values, t) || finish_streams(&cs);
    if (rc == 0) {
        CORE_CALL(&cs, rc,
                  ragvit_repack_into(&cs.st->ctx, &t[OUT], &t[SRC], &t[CU_SEQLENS_OUT], &t[PACKED],
                                     &t[CU_SEQLENS], &t[KEEP], &t[FUSE_WEIGHTS], cs.stream));
    }
    return call_end(&cs, rc ? NULL : Py_NewRef(Py_None), rc);
}
