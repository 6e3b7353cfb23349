/* status.c — the one status → message table and the per-thread message of
 * the last failure. Every failing core function returns through ragvit_fail,
 * which formats "<op>: <arg> must be <rule>, got <actual>" (or a CUDA error
 * with its expression and file:line) into a thread-local buffer; the glue's
 * status → exception map (csrc/python/errors.c) reads it once when it raises.
 * Decision: thread-local storage rather than an out-parameter keeps every
 * prototype short and is safe without the GIL. */
#include <stdarg.h>
#include <stdio.h>

#include "ragvit.h"

static _Thread_local char last_message[512];

static const char *const status_names[RAGVIT_STATUS_COUNT] = {
    [RAGVIT_STATUS_OK] = "ok",
    [RAGVIT_STATUS_INVALID_SHAPE] = "invalid shape",
    [RAGVIT_STATUS_INVALID_VALUE] = "invalid value",
    [RAGVIT_STATUS_INVALID_DTYPE] = "invalid dtype",
    [RAGVIT_STATUS_INVALID_DEVICE] = "invalid device",
    [RAGVIT_STATUS_NOT_IMPORTABLE] = "not importable",
    [RAGVIT_STATUS_READ_ONLY] = "read-only output",
    [RAGVIT_STATUS_NO_CUDA] = "built without CUDA",
    [RAGVIT_STATUS_OUT_OF_MEMORY] = "out of memory",
    [RAGVIT_STATUS_CUDA_ERROR] = "CUDA error",
    [RAGVIT_STATUS_DEVICE_ASSERT] = "device-side check failed",
    [RAGVIT_STATUS_INVALID_TYPE] = "invalid argument type",
};

const char *ragvit_status_string(ragvit_status status) {
    if ((int)status < 0 || status >= RAGVIT_STATUS_COUNT) return "unknown status";
    return status_names[status];
}

const char *ragvit_error_message(void) { return last_message; }

ragvit_status ragvit_fail(ragvit_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_message, sizeof last_message, fmt, args);
    va_end(args);
    return status;
}

int ragvit_cuda_is_compiled(void) {
#ifdef RAGVIT_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}
