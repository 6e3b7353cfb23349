/* bind_rows.c — the row ops of ragvit._C on packed rows x (M, K) or (M, C):
 * linear (out (M, N) = x @ weight.T + bias + residual), layer_norm and gelu
 * (out (M, C)). Each out is allocated like x, (M, cols), when not given.
 * Decision: the wrappers check only the rank they need to size out; every
 * other check (dtype, strides, aliasing, devices) is the core's, so a given
 * out and an allocated one fail with the same messages. */
#include "glue.h"

/* *out_obj: a new reference to the given out, or a new (M, cols) array
 * allocated like x. */
static int rows_output(call_state *cs, PyObject *given, const ragvit_tensor *x, int64_t cols,
                       ragvit_tensor *out, PyObject **out_obj) {
    if (given != NULL) {
        *out_obj = Py_NewRef(given);
        return 0;
    }
    if (x->ndim != 2) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                         "%s: x must have 2 dimensions (M, K), got %d", cs->op,
                                         x->ndim));
    }
    const int64_t shape[2] = {x->shape[0], cols};
    *out_obj = alloc_like(cs, x, "out", x->dtype, 2, shape, out);
    return *out_obj == NULL ? -1 : 0;
}

PyObject *py_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    enum { X, WEIGHT, BIAS, RESIDUAL, OUT, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"x", "weight", "bias", "residual", "out", "stream"};
    static const op_signature sig =
        SIGNATURE("linear", names, 3, 2,
                  ARG_BIT(X) | ARG_BIT(WEIGHT) | ARG_BIT(BIAS) | ARG_BIT(RESIDUAL) | ARG_BIT(OUT),
                  ARG_BIT(OUT));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        call_import(&cs, values, t)) {
        goto done;
    }
    if (values[OUT] == NULL && t[WEIGHT].ndim != 2) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "linear: weight must have 2 dimensions (N, K), got %d",
                             t[WEIGHT].ndim));
    }
    if (rows_output(&cs, values[OUT], &t[X], values[OUT] == NULL ? t[WEIGHT].shape[0] : 0, &t[OUT],
                    &out_obj)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(
        &cs, rc,
        ragvit_linear(&cs.st->ctx, &t[OUT], &t[X], &t[WEIGHT], &t[BIAS], &t[RESIDUAL], cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}

PyObject *py_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    enum { X, WEIGHT, BIAS, EPS, OUT, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"x", "weight", "bias", "eps", "out", "stream"};
    static const op_signature sig =
        SIGNATURE("layer_norm", names, 3, 1,
                  ARG_BIT(X) | ARG_BIT(WEIGHT) | ARG_BIT(BIAS) | ARG_BIT(OUT), ARG_BIT(OUT));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    double eps;
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        parse_float(&cs, values, EPS, 1e-5, &eps) || call_import(&cs, values, t) ||
        rows_output(&cs, values[OUT], &t[X], t[X].ndim == 2 ? t[X].shape[1] : 0, &t[OUT],
                    &out_obj)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc,
              ragvit_layer_norm(&cs.st->ctx, &t[OUT], &t[X], &t[WEIGHT], &t[BIAS], eps, cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}

PyObject *py_gelu(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    enum { X, OUT, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"x", "out", "stream"};
    static const op_signature sig =
        SIGNATURE("gelu", names, 1, 1, ARG_BIT(X) | ARG_BIT(OUT), ARG_BIT(OUT));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        call_import(&cs, values, t) ||
        rows_output(&cs, values[OUT], &t[X], t[X].ndim == 2 ? t[X].shape[1] : 0, &t[OUT],
                    &out_obj)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc, ragvit_gelu(&cs.st->ctx, &t[OUT], &t[X], cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}
