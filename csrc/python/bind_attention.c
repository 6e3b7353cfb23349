/* bind_attention.c — ragvit._C.attention: per-sequence softmax attention over
 * packed tokens. q, k, v: (T, H, D) with any token/head strides; cu_seqlens:
 * (S+1,) int32; out: (T, H, D), allocated like q when not given.
 * Decision: an absent scale reaches the core as NULL rather than a number
 * computed here, so 1/sqrt(D) comes from the head dim the core validated. */
#include "glue.h"

PyObject *py_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames) {
    static const char *const names[] = {"q",     "k",   "v",        "cu_seqlens", "max_seqlen",
                                        "scale", "out", "cls_attn", "bias",       "stream"};
    PyObject *values[10];
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor q, k, v, cu, out, cls, bias;
    int64_t max_seqlen;
    double scale;
    call_state cs;
    call_init(&cs, module, "attention");
    if (parse_args(cs.op, args, nargs, kwnames, names, 10, 5, 4, values)) return NULL;
    if (parse_max_seqlen(&cs, values[4], &max_seqlen)) return NULL;
    if (parse_float(&cs, values[5], "scale", 0.0, &scale)) return NULL;
    if (parse_stream(&cs, values[9])) return NULL;
    if (import_arg(&cs, values[0], "q", &q) || import_arg(&cs, values[1], "k", &k) ||
        import_arg(&cs, values[2], "v", &v) || import_arg(&cs, values[3], "cu_seqlens", &cu) ||
        import_arg(&cs, values[6], "out", &out) || import_arg(&cs, values[7], "cls_attn", &cls) ||
        import_arg(&cs, values[8], "bias", &bias)) {
        goto done;
    }
    if (!out.is_present) {
        if (q.ndim != 3)
            RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                 "attention: q must have 3 dimensions, got %d", q.ndim));
        out_obj = alloc_like(&cs, 0, &q, "out", q.dtype, 3, q.shape, &out);
        if (out_obj == NULL) goto done;
    } else {
        out_obj = values[6];
        Py_INCREF(out_obj);
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_attention(&cs.st->ctx, &out, &cls, &q, &k, &v, &cu, &bias, max_seqlen,
                              values[5] ? &scale : NULL, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}
