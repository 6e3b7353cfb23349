/* bind_topk_index.c — ragvit._C.topk_index: per row of scores (B, L), the
 * `prefix` leading columns and the k highest-scoring columns after them, in
 * ascending order; out (B, prefix + k) int64 allocated like scores when not given.
 * Decision: out is allocated only for arguments the core will accept; for any
 * other scores, k or prefix it stays absent and the core raises its own message
 * about them (not about a missing out) before out is read. */
#include "glue.h"

PyObject *py_topk_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    static const char *const names[] = {"scores", "k", "prefix", "out", "stream"};
    PyObject *values[5];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor scores, out;
    long long k = 0, prefix = 0;
    call_state cs;
    call_init(&cs, module, "topk_index");
    if (parse_args(cs.op, args, nargs, kwnames, names, 5, 2, 2, values)) return NULL;
    if (parse_count(&cs, values[1], "k", &k)) return NULL;
    if (values[2] != NULL && parse_count(&cs, values[2], "prefix", &prefix)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "scores", &scores) || import_arg(&cs, values[3], "out", &out)) {
        goto done;
    }
    if (values[3] != NULL) {
        out_obj = values[3];
        Py_INCREF(out_obj);
    } else if (scores.ndim == 2 && scores.shape[1] <= RAGVIT_TOPK_MAX_COLS &&
               prefix + k <= scores.shape[1]) {
        /* Any other scores, k or prefix fails in the core before out is read. */
        const int64_t shape[2] = {scores.shape[0], prefix + k};
        out_obj = alloc_like(&cs, 0, &scores, "out", RAGVIT_DTYPE_I64, 2, shape, &out);
        if (out_obj == NULL) goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_topk_index(&cs.st->ctx, &out, &scores, k, prefix, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}
