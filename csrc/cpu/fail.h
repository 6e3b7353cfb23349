/* fail.h — how the C backend refuses a call or reports bad contents, shared by every
 * cpu/<op>.c. The core has validated everything it can see, so these paths guard
 * the rest: a dtype outside F16/BF16/F32, scratch that cannot be allocated, and
 * cu_seqlens / indices contents. Decision: a loop that meets bad contents skips that
 * sequence or token, keeps the first message (note_problem), finishes the in-bounds
 * work and returns INVALID_VALUE (problem_status), as the CUDA kernels write what
 * they can and raise their error flag. */
#ifndef RAGVIT_CPU_FAIL_H
#define RAGVIT_CPU_FAIL_H

#include "ragvit.h"

#include <stdarg.h>
#include <stdio.h>

#define MESSAGE_SIZE 256 /* bytes of a noted problem */

/* "<op>: <name> must be float16, bfloat16 or float32, got dtype code <dtype>". */
static inline ragvit_status cpu_fail_dtype(const char *op, const char *name, int32_t dtype) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                       "%s: %s must be float16, bfloat16 or float32, got dtype code %d", op, name,
                       (int)dtype);
}

static inline ragvit_status cpu_fail_scratch(const char *op, int64_t count) {
    return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                       "%s: scratch must be allocatable, got no memory for %lld floats", op,
                       (long long)count);
}

/* "<op>: cu_seqlens must be non-decreasing within [0, T]", for a loop that met a
 * bad range and summarises it once. */
static inline ragvit_status cpu_fail_cu_seqlens(const char *op, int64_t total_tokens) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                       "%s: cu_seqlens must be non-decreasing within [0, T=%lld]", op,
                       (long long)total_tokens);
}

/* 1 when rows [start, end) lie within [0, total]. */
static inline int range_is_valid(int64_t start, int64_t end, int64_t total) {
    return start >= 0 && end >= start && end <= total;
}

/* Formats a problem into msg (MESSAGE_SIZE bytes) unless msg is NULL or already
 * holds one: the first problem a loop meets is the one reported. */
static inline void note_problem(char *msg, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static inline void note_problem(char *msg, const char *fmt, ...) {
    if (msg == NULL || msg[0] != '\0') return;
    va_list args;
    va_start(args, fmt);
    vsnprintf(msg, MESSAGE_SIZE, fmt, args);
    va_end(args);
}

/* INVALID_VALUE with the noted problem, or OK when none was noted. */
static inline ragvit_status problem_status(const char *msg) {
    if (msg[0] != '\0') return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE, "%s", msg);
    return RAGVIT_STATUS_OK;
}

#endif /* RAGVIT_CPU_FAIL_H */
