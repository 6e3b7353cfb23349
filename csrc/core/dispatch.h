/* dispatch.h — the tail every core/<op>.c shares once its arguments are checked and
 * its argument struct is filled: host tensors go to the C backend (cpu/<op>.c),
 * device tensors to the CUDA launcher (kernels/launch.h) between dispatch_begin,
 * which finds the device's cached facts, and dispatch_end, which in debug mode reads
 * the device's error flag back. Decision: the launcher call is written inside
 * DISPATCH_CUDA so that a CPU-only build, which has no launchers, compiles the same
 * op code; there dispatch_begin refuses the call before anything would launch. */
#ifndef RAGVIT_DISPATCH_H
#define RAGVIT_DISPATCH_H

#include "cpu/cpu_backend.h"
#include "ragvit.h"

/* The tail, as every op writes it (ops whose kernels flag bad contents also set
 * a.error_flag = dev->error_flag before the launch):
 *     if (device_type == RAGVIT_DEVICE_CPU) return ragvit_cpu_<op>(&a);
 *     const ragvit_device_info *dev = NULL;
 *     RAGVIT_TRY(dispatch_begin(ctx, op, device_id, &dev));
 *     return dispatch_end(ctx, op, device_id, stream,
 *                         DISPATCH_CUDA(ragvit_cuda_<op>(&a, dev, stream))); */
#ifdef RAGVIT_WITH_CUDA
#include "kernels/launch.h"
#define DISPATCH_CUDA(launch) (launch)
#else
#define DISPATCH_CUDA(launch) RAGVIT_STATUS_NO_CUDA
#endif

/* Sets *dev to the facts of device_id (filled on first use) for a launch there; in a
 * CPU-only build, refuses with NO_CUDA naming op. */
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

/* The status of the launch when it failed; otherwise the debug-mode check of the
 * device's error flag (ragvit_context_finish), OK when debug mode is off. */
static inline ragvit_status dispatch_end(ragvit_context *ctx, const char *op, int32_t device_id,
                                         void *stream, ragvit_status launched) {
    if (launched != RAGVIT_STATUS_OK) return launched;
    return ragvit_context_finish(ctx, device_id, stream, op);
}

#endif /* RAGVIT_DISPATCH_H */
