/* graph_replay.c — host side of graph_replay: one replay of a captured CUDA graph as a
 * caller sees it (ragvit.cuda_graph's repeated-shape call), checked here and handed to
 * kernels/graph_replay.cu: x copied into the graph's static input, the graph launched, each
 * static output copied into a fresh output, all on the caller's stream. Shapes: x and
 * static_x alike, outs[i] and static_outs[i] alike, every one compact. Decision: the copies
 * are whole-buffer byte copies, so every tensor must be compact (a strided x would need a
 * kernel; the Python wrapper copies those itself), and everything is checked before the
 * first copy is queued, so a refused call leaves the graph's buffers as they were. */
#include <inttypes.h>
#include <stdio.h>

#include "core/dispatch.h"
#include "core/tensor.h"

/* Row-major with no gaps; extent-1 dims may have any stride. */
static int graph_replay_is_compact(const ragvit_tensor *t) {
    int64_t expected = 1;
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expected) return 0;
        expected *= t->shape[i];
    }
    return 1;
}

static size_t graph_replay_bytes(const ragvit_tensor *t) {
    int64_t numel = 1;
    for (int32_t i = 0; i < t->ndim; i++) numel *= t->shape[i];
    return (size_t)numel * (size_t)tensor_dtype_size(t->dtype);
}

/* t (named name) has ref's dtype and shape, and both are compact. */
static ragvit_status graph_replay_check_pair(const char *op, const char *name,
                                             const ragvit_tensor *t, const char *ref_name,
                                             const ragvit_tensor *ref) {
    RAGVIT_TRY(tensor_check_same_dtype(op, name, t, ref_name, ref));
    RAGVIT_TRY(tensor_check_shape(op, name, t, ref->ndim, ref->shape));
    const ragvit_tensor *pair[2] = {ref, t};
    const char *names[2] = {ref_name, name};
    for (int i = 0; i < 2; i++) {
        if (graph_replay_is_compact(pair[i])) continue;
        char strides[128];
        size_t used = (size_t)snprintf(strides, sizeof strides, "(");
        for (int32_t d = 0; d < pair[i]->ndim && used < sizeof strides; d++) {
            used += (size_t)snprintf(strides + used, sizeof strides - used, "%s%" PRId64,
                                     d ? ", " : "", pair[i]->strides[d]);
        }
        if (used < sizeof strides) snprintf(strides + used, sizeof strides - used, ")");
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must be contiguous (row-major, no gaps), got strides %s", op,
                           names[i], strides);
    }
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_graph_replay(ragvit_context *ctx, const ragvit_tensor *outs,
                                  const ragvit_tensor *static_x, const ragvit_tensor *x,
                                  const ragvit_tensor *static_outs, int32_t count, void *graph_exec,
                                  void *stream) {
    static const char op[] = "graph_replay";
    /* Refused first, whatever the arguments: a CPU-only build has no graph to replay. */
    if (!ragvit_cuda_is_compiled()) {
        return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                           "%s: replaying a CUDA graph needs a CUDA build of ragvit, got a "
                           "CPU-only build (no nvcc was found when it was built)",
                           op);
    }
    if (count < 0 || count > RAGVIT_GRAPH_MAX_OUTPUTS) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: outputs must hold at most %d tensors, got %" PRId32, op,
                           RAGVIT_GRAPH_MAX_OUTPUTS, count);
    }
    if (graph_exec == NULL) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: graph_exec must be an instantiated cudaGraphExec_t, got 0", op);
    }
    /* Names for messages: outputs[i] are the graph's, out[i] the fresh copies. */
    static const char *const static_names[RAGVIT_GRAPH_MAX_OUTPUTS] = {
        "outputs[0]", "outputs[1]", "outputs[2]", "outputs[3]", "outputs[4]", "outputs[5]"};
    static const char *const out_names[RAGVIT_GRAPH_MAX_OUTPUTS] = {"out[0]", "out[1]", "out[2]",
                                                                    "out[3]", "out[4]", "out[5]"};
    const char *names[2 + 2 * RAGVIT_GRAPH_MAX_OUTPUTS] = {"x", "static_x"};
    const ragvit_tensor *all[2 + 2 * RAGVIT_GRAPH_MAX_OUTPUTS] = {x, static_x};
    int n = 2;
    for (int32_t i = 0; i < count; i++) {
        names[n] = static_names[i];
        all[n++] = &static_outs[i];
        names[n] = out_names[i];
        all[n++] = &outs[i];
    }
    int32_t device_type = 0, device_id = 0;
    RAGVIT_TRY(tensor_check_devices(op, names, all, n, &device_type, &device_id));
    if (device_type != RAGVIT_DEVICE_CUDA) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_DEVICE,
                           "%s: x must be on a CUDA device (the graph's), got the host", op);
    }
    RAGVIT_TRY(graph_replay_check_pair(op, "x", x, "static_x", static_x));
    RAGVIT_TRY(tensor_check_writable(op, "static_x", static_x));
    /* x may be static_x itself (nothing to copy), never a part of it. */
    if (x->data != static_x->data) {
        RAGVIT_TRY(tensor_check_no_alias(op, "static_x", static_x, "x", x));
    }
    ragvit_graph_replay_args a = {
        .graph_exec = graph_exec,
        .static_x = static_x->data,
        .x = x->data,
        .x_bytes = graph_replay_bytes(x),
        .count = count,
    };
    for (int32_t i = 0; i < count; i++) {
        RAGVIT_TRY(
            graph_replay_check_pair(op, out_names[i], &outs[i], static_names[i], &static_outs[i]));
        RAGVIT_TRY(tensor_check_writable(op, out_names[i], &outs[i]));
        const ragvit_tensor *reads[2] = {&static_outs[i], static_x};
        const char *read_names[2] = {static_names[i], "static_x"};
        RAGVIT_TRY(tensor_check_no_alias_any(op, out_names[i], &outs[i], read_names, reads, 2));
        a.outs[i] = outs[i].data;
        a.static_outs[i] = static_outs[i].data;
        a.out_bytes[i] = graph_replay_bytes(&outs[i]);
    }
#ifndef RAGVIT_WITH_CUDA
    (void)a; /* DISPATCH_CUDA drops the launch in a CPU-only build */
#endif
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
    return dispatch_end(ctx, op, device_id, stream,
                        DISPATCH_CUDA(ragvit_cuda_graph_replay(&a, dev, stream)));
}
