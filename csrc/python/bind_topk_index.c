/* bind_topk_index.c — ragvit._C.topk_index: per row of scores (B, L), the
 * `prefix` leading columns and the k highest-scoring columns after them, in
 * ascending order; out (B, prefix + k) int64 allocated like scores when not given.
 * Decision: out is allocated only for arguments the core will accept; for any
 * other scores, k or prefix it stays absent and the core raises its own message
 * about them (not about a missing out) before out is read. */
#include "glue.h"

PyObject *py_topk_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    enum { SCORES, K, PREFIX, OUT, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"scores", "k", "prefix", "out", "stream"};
    static const op_signature sig =
        SIGNATURE("topk_index", names, 2, 2, ARG_BIT(SCORES) | ARG_BIT(OUT), ARG_BIT(OUT));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    long long k = 0, prefix = 0;
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        parse_count(&cs, values, K, &k) || parse_count(&cs, values, PREFIX, &prefix) ||
        call_import(&cs, values, t)) {
        goto done;
    }
    const ragvit_tensor *scores = &t[SCORES];
    if (values[OUT] != NULL) {
        out_obj = Py_NewRef(values[OUT]);
    } else if (scores->ndim == 2 && scores->shape[1] <= RAGVIT_TOPK_MAX_COLS &&
               prefix + k <= scores->shape[1]) {
        const int64_t shape[2] = {scores->shape[0], prefix + k};
        out_obj = alloc_like(&cs, scores, "out", RAGVIT_DTYPE_I64, 2, shape, &t[OUT]);
        if (out_obj == NULL) goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc, ragvit_topk_index(&cs.st->ctx, &t[OUT], scores, k, prefix, cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}
