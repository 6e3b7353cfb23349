/* bind_rows.c — the row ops of ragvit._C on packed rows x (M, K) or (M, C):
 * linear (out (M, N) = x @ weight.T + bias + residual), layer_norm and gelu
 * (out (M, C)). Each out is allocated like x, (M, cols), when not given.
 * Decision: the wrappers check only the rank they need to size out; every
 * other check (dtype, strides, aliasing, devices) is the core's, so a given
 * out and an allocated one fail with the same messages. */
#include "glue.h"

/* New reference to the given out, or a new (rows, cols) array allocated like
 * the argument in slot 0 (x); NULL with an exception. */
static PyObject *rows_output(call_state *cs, PyObject *given, const ragvit_tensor *x, int64_t cols,
                             ragvit_tensor *out) {
    if (given != NULL) {
        Py_INCREF(given);
        return given;
    }
    if (x->ndim != 2) {
        raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                  "%s: x must have 2 dimensions (M, K), got %d", cs->op, x->ndim));
        return NULL;
    }
    const int64_t shape[2] = {x->shape[0], cols};
    return alloc_like(cs, 0, x, "out", x->dtype, 2, shape, out);
}

PyObject *py_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "weight", "bias", "residual", "out", "stream"};
    PyObject *values[6];
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor x, w, bias, res, out;
    call_state cs;
    call_init(&cs, module, "linear");
    if (parse_args(cs.op, args, nargs, kwnames, names, 6, 3, 2, values)) return NULL;
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "weight", &w) ||
        import_arg(&cs, values[2], "bias", &bias) || import_arg(&cs, values[3], "residual", &res) ||
        import_arg(&cs, values[4], "out", &out)) {
        goto done;
    }
    if (values[4] == NULL && w.ndim != 2) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "linear: weight must have 2 dimensions (N, K), got %d", w.ndim));
    }
    out_obj = rows_output(&cs, values[4], &x, values[4] == NULL ? w.shape[0] : 0, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_linear(&cs.st->ctx, &out, &x, &w, &bias, &res, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

/* layer_norm (has_affine) and gelu: (x, [weight, bias,] *, [eps,] out, stream). */
static PyObject *rowwise_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames, int has_affine) {
    static const char *const ln_names[] = {"x", "weight", "bias", "eps", "out", "stream"};
    static const char *const gelu_names[] = {"x", "out", "stream"};
    PyObject *values[6] = {NULL};
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor x, w, bias, out;
    double eps = 1e-5;
    call_state cs;
    call_init(&cs, module, has_affine ? "layer_norm" : "gelu");
    if (has_affine) {
        if (parse_args(cs.op, args, nargs, kwnames, ln_names, 6, 3, 1, values)) return NULL;
        if (parse_float(&cs, values[3], "eps", 1e-5, &eps)) return NULL;
    } else {
        /* gelu's (x, out, stream) land in the slots layer_norm uses for them */
        PyObject *g[3];
        if (parse_args(cs.op, args, nargs, kwnames, gelu_names, 3, 1, 1, g)) return NULL;
        values[0] = g[0];
        values[4] = g[1];
        values[5] = g[2];
    }
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "weight", &w) ||
        import_arg(&cs, values[2], "bias", &bias) || import_arg(&cs, values[4], "out", &out)) {
        goto done;
    }
    out_obj = rows_output(&cs, values[4], &x, x.ndim == 2 ? x.shape[1] : 0, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(has_affine ? ragvit_layer_norm(&cs.st->ctx, &out, &x, &w, &bias, eps, cs.stream)
                        : ragvit_gelu(&cs.st->ctx, &out, &x, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

PyObject *py_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    return rowwise_op(module, args, nargs, kwnames, 1);
}

PyObject *py_gelu(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return rowwise_op(module, args, nargs, kwnames, 0);
}
