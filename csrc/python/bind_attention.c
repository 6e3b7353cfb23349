/* bind_attention.c — ragvit._C.attention: per-sequence softmax attention over
 * packed tokens. q, k, v: (T, H, D) with any token/head strides; cu_seqlens:
 * (S+1,) int32; out: (T, H, D), allocated like q when not given.
 * Decision: an absent scale reaches the core as NULL rather than a number
 * computed here, so 1/sqrt(D) comes from the head dim the core validated. */
#include "glue.h"

PyObject *py_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames) {
    enum { Q, K, V, CU_SEQLENS, MAX_SEQLEN, SCALE, OUT, CLS_ATTN, BIAS, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {
        "q", "k", "v", "cu_seqlens", "max_seqlen", "scale", "out", "cls_attn", "bias", "stream"};
    static const op_signature sig =
        SIGNATURE("attention", names, 5, 4,
                  ARG_BIT(Q) | ARG_BIT(K) | ARG_BIT(V) | ARG_BIT(CU_SEQLENS) | ARG_BIT(OUT) |
                      ARG_BIT(CLS_ATTN) | ARG_BIT(BIAS),
                  ARG_BIT(OUT) | ARG_BIT(CLS_ATTN));
    PyObject *values[NUM_ARGS], *out_obj = NULL; /* out_obj: owned */
    ragvit_tensor t[NUM_ARGS];
    int64_t max_seqlen;
    double scale;
    call_state cs;
    int rc = -1;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values) ||
        parse_max_seqlen(&cs, values, MAX_SEQLEN, &max_seqlen) ||
        parse_float(&cs, values, SCALE, 0.0, &scale) || call_import(&cs, values, t)) {
        goto done;
    }
    if (values[OUT] == NULL) {
        if (t[Q].ndim != 3)
            RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                 "attention: q must have 3 dimensions, got %d", t[Q].ndim));
        out_obj = alloc_like(&cs, &t[Q], "out", t[Q].dtype, 3, t[Q].shape, &t[OUT]);
        if (out_obj == NULL) goto done;
    } else {
        out_obj = Py_NewRef(values[OUT]);
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc,
              ragvit_attention(&cs.st->ctx, &t[OUT], &t[CLS_ATTN], &t[Q], &t[K], &t[V],
                               &t[CU_SEQLENS], &t[BIAS], max_seqlen, values[SCALE] ? &scale : NULL,
                               cs.stream));
done:
    return call_end(&cs, out_obj, rc);
}
