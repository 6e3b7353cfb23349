/* fail.h — how the C backend reports what it cannot do, shared by every cpu/<op>.c.
 * The core has validated everything it can see, so these paths guard against
 * contents: a loop that meets bad cu_seqlens / indices skips that sequence or token,
 * keeps the first message in a MESSAGE_SIZE buffer, finishes the in-bounds work and
 * returns INVALID_VALUE, as the CUDA kernels write what they can and raise their
 * error flag. */
#ifndef RAGVIT_CPU_FAIL_H
#define RAGVIT_CPU_FAIL_H

#include "ragvit.h"

#define MESSAGE_SIZE 256

static inline ragvit_status cpu_scratch_fail(const char *op, int64_t count) {
    return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                       "%s: scratch must be allocatable, got no memory for %lld floats", op,
                       (long long)count);
}

#endif /* RAGVIT_CPU_FAIL_H */
