/* context.c — process state the Python module owns (ragvit_context): the
 * debug switch and per-device facts (SM count, error flag) filled on first
 * use, plus the few host-side helpers that need the device (reading one
 * int32, reading the error flag, cross-stream waits). Decision: device facts
 * are cached here, once, so no launch ever queries device properties. */
#include <inttypes.h>
#include <string.h>

#include "core/tensor.h"
#include "kernels/launch.h"

void ragvit_context_init(ragvit_context *ctx) { memset(ctx, 0, sizeof *ctx); }

void ragvit_context_release(ragvit_context *ctx) {
#ifdef RAGVIT_WITH_CUDA
    for (int i = 0; i < RAGVIT_MAX_DEVICES; i++) {
        if (ctx->devices[i].is_initialized) ragvit_cuda_device_release(&ctx->devices[i]);
    }
#endif
    memset(ctx, 0, sizeof *ctx);
}

#ifndef RAGVIT_WITH_CUDA
static ragvit_status no_cuda(const char *what) {
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "%s: CUDA tensors need a CUDA build of ragvit, got a CPU-only build "
                       "(no nvcc was found when it was built)",
                       what);
}
#endif

ragvit_status ragvit_context_device(ragvit_context *ctx, int32_t device_id,
                                    const ragvit_device_info **dev) {
    if (device_id < 0 || device_id >= RAGVIT_MAX_DEVICES) {
        return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                           "ragvit: device index must be in [0, %d), got %" PRId32,
                           RAGVIT_MAX_DEVICES, device_id);
    }
#ifdef RAGVIT_WITH_CUDA
    ragvit_device_info *info = &ctx->devices[device_id];
    if (!info->is_initialized) RAGVIT_TRY(ragvit_cuda_device_init(device_id, info));
    *dev = info;
    return RAGVIT_STATUS_OK;
#else
    (void)ctx;
    (void)dev;
    return no_cuda("ragvit");
#endif
}

ragvit_status ragvit_context_check_device(ragvit_context *ctx, int32_t device_id, void *stream,
                                          const char *op) {
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    unsigned int bits = 0;
    RAGVIT_TRY(ragvit_context_device(ctx, device_id, &dev));
    RAGVIT_TRY(ragvit_cuda_read_error_flag(dev, stream, &bits));
    if (bits == 0) return RAGVIT_STATUS_OK;
    return ragvit_fail(
        RAGVIT_STATUS_DEVICE_ASSERT,
        "%s: device contents must be valid, got%s%s%s%s%s (debug check, flag 0x%x)", op,
        bits & RAGVIT_ERROR_BAD_CU_SEQLENS
            ? " cu_seqlens negative, decreasing or past total_tokens;"
            : "",
        bits & RAGVIT_ERROR_SEQLEN_OVER_MAX ? " a cu_seqlens length above max_seqlen or N;" : "",
        bits & RAGVIT_ERROR_CAPACITY ? " more kept tokens than out can hold;" : "",
        bits & RAGVIT_ERROR_BAD_INDEX ? " indices outside [0, N);" : "",
        bits & RAGVIT_ERROR_SHORT_SEQ ? " a sequence shorter than k;" : "", bits);
#else
    (void)ctx;
    (void)device_id;
    (void)stream;
    return no_cuda(op);
#endif
}

ragvit_status ragvit_context_finish(ragvit_context *ctx, int32_t device_id, void *stream,
                                    const char *op) {
    return ctx->is_debug ? ragvit_context_check_device(ctx, device_id, stream, op)
                         : RAGVIT_STATUS_OK;
}

ragvit_status ragvit_read_int32(int32_t *value, const ragvit_tensor *t, int64_t index,
                                void *stream) {
    const int32_t *src = (const int32_t *)t->data + index * t->strides[0];
    if (t->device_type == RAGVIT_DEVICE_CPU) {
        *value = *src;
        return RAGVIT_STATUS_OK;
    }
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_read_int32(t->device_id, src, stream, value);
#else
    (void)stream;
    return no_cuda("ragvit");
#endif
}

ragvit_status ragvit_device_count(int32_t *count) {
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_device_count(count);
#else
    *count = 0;
    return RAGVIT_STATUS_OK;
#endif
}

ragvit_status ragvit_launch_empty(ragvit_context *ctx, int32_t device_id, void *stream) {
#ifdef RAGVIT_WITH_CUDA
    const ragvit_device_info *dev = NULL;
    RAGVIT_TRY(ragvit_context_device(ctx, device_id, &dev));
    return ragvit_cuda_launch_empty(dev, stream);
#else
    (void)ctx;
    (void)device_id;
    (void)stream;
    return no_cuda("launch_empty");
#endif
}

ragvit_status ragvit_stream_wait(int32_t device_id, void *consumer, void *producer) {
#ifdef RAGVIT_WITH_CUDA
    if (consumer == producer) return RAGVIT_STATUS_OK;
    return ragvit_cuda_stream_wait(device_id, consumer, producer);
#else
    (void)device_id;
    (void)consumer;
    (void)producer;
    return no_cuda("ragvit");
#endif
}

ragvit_status ragvit_pointer_device(const void *ptr, int32_t *device_id) {
#ifdef RAGVIT_WITH_CUDA
    return ragvit_cuda_pointer_device(ptr, device_id);
#else
    (void)ptr;
    *device_id = 0;
    return RAGVIT_STATUS_OK;
#endif
}
