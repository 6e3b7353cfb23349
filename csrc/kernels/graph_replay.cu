/* graph_replay.cu — the CUDA half of graph_replay: the caller's input copied into the
 * graph's static input, the captured graph launched, each static output copied into a fresh
 * output, all on the caller's stream with the graph's device current. No kernel of ragvit's:
 * two or more cudaMemcpyAsync and one cudaGraphLaunch, checked one by one.
 * Decision: this is all torch.cuda.CUDAGraph.replay() does for a graph that draws no random
 * numbers (its generator prologue is a no-op then, and the caller checks for that); doing it
 * from C saves the Python and dispatcher layers around each of the three steps.
 * Covered by tests/test_graph.py (the graph_replay and fast-path cases). */
#include "cuda_util.cuh"

// ---- launcher ----

extern "C" ragvit_status ragvit_cuda_graph_replay(const ragvit_graph_replay_args *a,
                                                  const ragvit_device_info *dev, void *stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    if (a->x_bytes > 0 && a->x != a->static_x) {
        CUDA_TRY(cudaMemcpyAsync(a->static_x, a->x, a->x_bytes, cudaMemcpyDeviceToDevice, s));
    }
    CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)a->graph_exec, s));
    for (int32_t i = 0; i < a->count; i++) {
        if (a->out_bytes[i] == 0) continue;
        CUDA_TRY(cudaMemcpyAsync(a->outs[i], a->static_outs[i], a->out_bytes[i],
                                 cudaMemcpyDeviceToDevice, s));
    }
    return RAGVIT_STATUS_OK;
}
