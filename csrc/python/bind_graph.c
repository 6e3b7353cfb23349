/* bind_graph.c — graph_replay(graph_exec, x, static_x, outputs, *, stream=None): one replay
 * of a captured CUDA graph in one C call, the repeated-shape call of ragvit.cuda_graph. x
 * and static_x are imported like any op's arrays, so are the graph's outputs (a tensor or a
 * tuple of up to RAGVIT_GRAPH_MAX_OUTPUTS); the fresh outputs come from x's exchange-API
 * allocator on the call's stream (torch's current stream of x's device), and come back in
 * the form `outputs` was given in.
 * Decision: two signatures. The Python one has four names; the one call_import reads spells
 * the graph's outputs out as arrays of their own (outputs[0], ...), so they go through the
 * same import, stream and version-counter rules as every op's arrays. */
#include "glue.h"

PyObject *py_graph_replay(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    enum { GRAPH_EXEC, X, STATIC_X, OUTPUTS, STREAM, NUM_ARGS };
    static const char *const names[NUM_ARGS] = {"graph_exec", "x", "static_x", "outputs", "stream"};
    static const op_signature sig = SIGNATURE("graph_replay", names, 4, 4, 0, 0);
    enum {
        IMPORT_X,
        IMPORT_STATIC_X,
        IMPORT_OUTPUTS,
        IMPORT_STREAM = IMPORT_OUTPUTS + RAGVIT_GRAPH_MAX_OUTPUTS,
        NUM_IMPORTS
    };
    static const char *const import_names[NUM_IMPORTS] = {"x",          "static_x",   "outputs[0]",
                                                          "outputs[1]", "outputs[2]", "outputs[3]",
                                                          "outputs[4]", "outputs[5]", "stream"};
    /* Written by the call: static_x (the copy in) and the graph's outputs (the replay). */
    static const op_signature import_sig =
        SIGNATURE("graph_replay", import_names, 0, 0, (1u << IMPORT_STREAM) - 1u,
                  ((1u << IMPORT_STREAM) - 1u) & ~ARG_BIT(IMPORT_X));
    static const char *const out_names[RAGVIT_GRAPH_MAX_OUTPUTS] = {"out[0]", "out[1]", "out[2]",
                                                                    "out[3]", "out[4]", "out[5]"};
    PyObject *values[NUM_ARGS], *imports[NUM_IMPORTS];
    PyObject *fresh[RAGVIT_GRAPH_MAX_OUTPUTS] = {NULL}; /* owned until moved into result */
    PyObject *result = NULL;                            /* owned */
    ragvit_tensor t[NUM_IMPORTS], outs[RAGVIT_GRAPH_MAX_OUTPUTS];
    call_state cs;
    int rc = -1, count = 0, is_tuple = 0;
    void *graph_exec = NULL;
    if (call_begin(&cs, module, &sig, args, nargs, kwnames, values)) goto done;
    if (!PyLong_Check(values[GRAPH_EXEC])) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                             "graph_replay: graph_exec must be an int (a cudaGraphExec_t "
                             "handle), got %s",
                             Py_TYPE(values[GRAPH_EXEC])->tp_name));
    }
    graph_exec = PyLong_AsVoidPtr(values[GRAPH_EXEC]);
    if (graph_exec == NULL && PyErr_Occurred()) goto done;
    for (int i = 0; i < NUM_IMPORTS; i++) imports[i] = NULL;
    imports[IMPORT_X] = values[X];
    imports[IMPORT_STATIC_X] = values[STATIC_X];
    imports[IMPORT_STREAM] = values[STREAM];
    if (PyTuple_Check(values[OUTPUTS])) {
        is_tuple = 1;
        count = (int)PyTuple_GET_SIZE(values[OUTPUTS]);
        if (count > RAGVIT_GRAPH_MAX_OUTPUTS) {
            RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                                 "graph_replay: outputs must hold at most %d tensors, got %d",
                                 RAGVIT_GRAPH_MAX_OUTPUTS, count));
        }
        for (int i = 0; i < count; i++) {
            /* borrowed: the tuple is an argument, held for the whole call */
            imports[IMPORT_OUTPUTS + i] = PyTuple_GET_ITEM(values[OUTPUTS], i);
            if (imports[IMPORT_OUTPUTS + i] == Py_None) {
                RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                                     "graph_replay: outputs[%d] must be a tensor, got None", i));
            }
        }
    } else if (PyList_Check(values[OUTPUTS])) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                             "graph_replay: outputs must be a tensor or a tuple of tensors, got "
                             "list"));
    } else {
        count = 1;
        imports[IMPORT_OUTPUTS] = values[OUTPUTS];
    }
    cs.sig = &import_sig;
    if (call_import(&cs, imports, t)) goto done;
    /* Slot 0 is x (the first array, always present): the fresh outputs are its library's. */
    const import_slot *slot = &cs.slots[0];
    if (slot->kind != IMPORT_EXCHANGE || slot->api->managed_tensor_allocator == NULL ||
        slot->api->managed_tensor_to_py_object_no_sync == NULL) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                             "graph_replay: x must be a tensor whose library allocates through "
                             "the DLPack exchange API (torch), got %s",
                             Py_TYPE(values[X])->tp_name));
    }
    for (int i = 0; i < count; i++) {
        const ragvit_tensor *like = &t[IMPORT_OUTPUTS + i];
        fresh[i] =
            alloc_like(&cs, like, out_names[i], like->dtype, like->ndim, like->shape, &outs[i]);
        if (fresh[i] == NULL) goto done;
    }
    if (finish_streams(&cs)) goto done;
    CORE_CALL(&cs, rc,
              ragvit_graph_replay(&cs.st->ctx, outs, &t[IMPORT_STATIC_X], &t[IMPORT_X],
                                  &t[IMPORT_OUTPUTS], count, graph_exec, cs.stream));
    if (rc != 0) goto done;
    if (!is_tuple) {
        result = fresh[0]; /* moved */
        fresh[0] = NULL;
    } else {
        result = PyTuple_New(count);
        if (result == NULL) {
            rc = -1;
            goto done;
        }
        for (int i = 0; i < count; i++) {
            PyTuple_SET_ITEM(result, i, fresh[i]); /* steals */
            fresh[i] = NULL;
        }
    }
done:
    for (int i = 0; i < RAGVIT_GRAPH_MAX_OUTPUTS; i++) Py_XDECREF(fresh[i]);
    return call_end(&cs, result, rc);
}
