/* dispatch.h — the tail every op shares once its arguments are checked and its
 * argument struct is filled: host tensors go to the C backend (csrc/cpu/), device
 * tensors to the CUDA launcher (kernels/launch.h) between dispatch_begin, which
 * finds the device's cached facts, and dispatch_end, which in debug mode reads the
 * device's error flag back. Decision: the launcher call is written inside
 * DISPATCH_CUDA so that a CPU-only build, which has no launchers, compiles the same
 * op code; there dispatch_begin refuses the call before anything would launch. */
#ifndef RAGVIT_DISPATCH_H
#define RAGVIT_DISPATCH_H

#include "cpu/cpu_backend.h"
#include "ragvit.h"

#ifdef RAGVIT_WITH_CUDA
#include "kernels/launch.h"
#define DISPATCH_CUDA(launch) (launch)
#else
#define DISPATCH_CUDA(launch) RAGVIT_STATUS_NO_CUDA
#endif

/* *dev for a launch on device_id (initialized on first use); NO_CUDA naming op in
 * a CPU-only build. */
static inline ragvit_status dispatch_begin(ragvit_context *ctx, const char *op, int32_t device_id,
                                           const ragvit_device_info **dev) {
#ifdef RAGVIT_WITH_CUDA
    (void)op;
    return ragvit_context_device(ctx, device_id, dev);
#else
    (void)ctx;
    (void)device_id;
    (void)dev;
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "%s: CUDA arrays need a CUDA build of ragvit, got a CPU-only build (no nvcc "
                       "was found when it was built)",
                       op);
#endif
}

/* launched, or after a successful launch the debug-mode check of the device's
 * error flag (ragvit_context_finish). */
static inline ragvit_status dispatch_end(ragvit_context *ctx, const char *op, int32_t device_id,
                                         void *stream, ragvit_status launched) {
    if (launched != RAGVIT_STATUS_OK) return launched;
    return ragvit_context_finish(ctx, device_id, stream, op);
}

#endif /* RAGVIT_DISPATCH_H */
