/* memory.c — the memory of outputs ragvit allocates itself (for callers whose array library
 * offers no allocator): host memory aligned to 64 bytes, or CUDA memory allocated and freed
 * in stream order from a per-device pool (kernels/device.cu), so a call that allocates pays
 * no cudaMalloc and no synchronization. Sizes are bytes; at least one byte is allocated, so
 * an empty output still has a data pointer to hand over.
 * A CUDA buffer is ordered by marks (kernels/device.cu: pooled events, shared by the buffers of
 * one call, reference counted); one last used on the legacy default stream is kept for the next
 * allocation of its size there, which that stream orders by itself.
 * Decision: the free takes no context: the glue's buffer object frees from its deallocator,
 * which may run after the module (and its context) is gone. */
#include <stdlib.h>

#include "ragvit.h"
#include "kernels/launch.h"

#define MEMORY_HOST_ALIGNMENT 64

#ifndef RAGVIT_WITH_CUDA
/* What every CUDA-memory entry point says in a CPU-only build. */
static ragvit_status memory_no_cuda(void) {
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "ragvit: CUDA memory needs a CUDA build of ragvit, got a CPU-only build");
}
#endif

ragvit_status ragvit_memory_alloc(ragvit_context *ctx, int32_t device_type, int32_t device_id,
                                  size_t bytes, void *stream, void **data) {
    *data = NULL;
    if (bytes == 0) bytes = 1;
    if (device_type == RAGVIT_DEVICE_CPU) {
        const size_t rounded =
            (bytes + MEMORY_HOST_ALIGNMENT - 1) / MEMORY_HOST_ALIGNMENT * MEMORY_HOST_ALIGNMENT;
        if (rounded < bytes) {
            return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY, "ragvit: cannot allocate %zu bytes",
                               bytes);
        }
        *data = aligned_alloc(MEMORY_HOST_ALIGNMENT, rounded);
        if (*data == NULL) {
            return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                               "ragvit: cannot allocate %zu bytes of host memory", bytes);
        }
        return RAGVIT_STATUS_OK;
    }
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(ragvit_context_device(ctx, device_id, &dev));
    /* The context owns its device facts: the pool is cached in them on first use. */
    return ragvit_cuda_memory_alloc(&ctx->devices[dev->device_id], bytes, stream, data);
#else
    (void)ctx;
    (void)device_id;
    (void)stream;
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "ragvit: CUDA tensors need a CUDA build of ragvit, got a CPU-only build");
#endif
}

ragvit_status ragvit_memory_mark(int32_t device_id, void *stream, void **mark) {
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_memory_mark(device_id, stream, mark);
#else
    (void)device_id;
    (void)stream;
    *mark = NULL;
    return memory_no_cuda();
#endif
}

void ragvit_memory_mark_retain(void *mark) {
#ifdef RAGVIT_WITH_CUDA
    if (mark != NULL) ragvit_cuda_memory_mark_retain(mark);
#else
    (void)mark;
#endif
}

void ragvit_memory_mark_release(void *mark) {
#ifdef RAGVIT_WITH_CUDA
    if (mark != NULL) ragvit_cuda_memory_mark_release(mark);
#else
    (void)mark;
#endif
}

ragvit_status ragvit_memory_wait(int32_t device_id, void *stream, void *mark) {
    if (mark == NULL) return RAGVIT_STATUS_OK;
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_memory_wait(device_id, stream, mark);
#else
    (void)device_id;
    (void)stream;
    return memory_no_cuda();
#endif
}

ragvit_status ragvit_memory_stream(int32_t device_id, void *mark, void **stream) {
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_memory_stream(device_id, mark, stream);
#else
    (void)device_id;
    (void)mark;
    *stream = NULL;
    return memory_no_cuda();
#endif
}

ragvit_status ragvit_memory_free(int32_t device_type, int32_t device_id, void *data, size_t bytes,
                                 void *mark) {
    if (data == NULL) return RAGVIT_STATUS_OK;
    if (device_type == RAGVIT_DEVICE_CPU) {
        free(data);
        return RAGVIT_STATUS_OK;
    }
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_memory_free(device_id, data, bytes == 0 ? 1 : bytes, mark);
#else
    (void)device_id;
    (void)bytes;
    (void)mark;
    return memory_no_cuda();
#endif
}

ragvit_status ragvit_memory_stats(int32_t device_id, int64_t *events, int64_t *marks,
                                  int64_t *reused) {
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_memory_stats(device_id, events, marks, reused);
#else
    (void)device_id;
    *events = 0;
    *marks = 0;
    *reused = 0;
    return memory_no_cuda();
#endif
}
