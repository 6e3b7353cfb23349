/* tensor.h — pure-C checks on ragvit_tensor views shared by every op's host
 * side (every csrc/core/<op>.c). Each check returns RAGVIT_STATUS_OK or fails
 * through ragvit_fail with "<op>: <name> must be <rule>, got <actual>". */
#ifndef RAGVIT_TENSOR_H
#define RAGVIT_TENSOR_H

#include "ragvit.h"

const char *tensor_dtype_name(int32_t dtype);
static inline int32_t tensor_dtype_size(int32_t dtype) { /* bytes; 0 for an unknown dtype */
    static const int32_t sizes[RAGVIT_DTYPE_COUNT] = {
        [RAGVIT_DTYPE_F16] = 2,  [RAGVIT_DTYPE_BF16] = 2, [RAGVIT_DTYPE_F32] = 4,
        [RAGVIT_DTYPE_I32] = 4,  [RAGVIT_DTYPE_I64] = 8,  [RAGVIT_DTYPE_U8] = 1,
        [RAGVIT_DTYPE_BOOL] = 1, [RAGVIT_DTYPE_F64] = 8,
    };
    return (dtype < 0 || dtype >= RAGVIT_DTYPE_COUNT) ? 0 : sizes[dtype];
}
static inline int tensor_is_float(int32_t dtype) { /* F16, BF16, F32 */
    return dtype == RAGVIT_DTYPE_F16 || dtype == RAGVIT_DTYPE_BF16 || dtype == RAGVIT_DTYPE_F32;
}

/* The checks below are inline predicates (the hot path pays no call); each
 * failure is formatted out of line by its tensor_fail_* twin in tensor.c. */
ragvit_status tensor_fail_ndim(const char *op, const char *name, const ragvit_tensor *t,
                               int32_t ndim);
ragvit_status tensor_fail_shape(const char *op, const char *name, const ragvit_tensor *t,
                                int32_t ndim, const int64_t *shape);
ragvit_status tensor_fail_float(const char *op, const char *name, const ragvit_tensor *t);
ragvit_status tensor_fail_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                int32_t dtype);
ragvit_status tensor_fail_same_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                     const char *ref_name, const ragvit_tensor *ref);
ragvit_status tensor_fail_last_contiguous(const char *op, const char *name, const ragvit_tensor *t);
ragvit_status tensor_fail_writable(const char *op, const char *name, const ragvit_tensor *t);
ragvit_status tensor_check_no_self_overlap_sorted(const char *op, const char *name,
                                                  const ragvit_tensor *t);
/* out must share no byte with any present ins[i] on its device (named names[i]);
 * conservative: compares byte extents, out's computed once. */
ragvit_status tensor_check_no_alias_any(const char *op, const char *name, const ragvit_tensor *out,
                                        const char *const *names, const ragvit_tensor *const *ins,
                                        int count);

static inline ragvit_status tensor_check_ndim(const char *op, const char *name,
                                              const ragvit_tensor *t, int32_t ndim) {
    return t->ndim == ndim ? RAGVIT_STATUS_OK : tensor_fail_ndim(op, name, t, ndim);
}

/* Extent -1 in `shape` matches anything. */
static inline ragvit_status tensor_check_shape(const char *op, const char *name,
                                               const ragvit_tensor *t, int32_t ndim,
                                               const int64_t *shape) {
    int ok = t->ndim == ndim;
    for (int32_t i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || shape[i] == t->shape[i];
    return ok ? RAGVIT_STATUS_OK : tensor_fail_shape(op, name, t, ndim, shape);
}

static inline ragvit_status tensor_check_float(const char *op, const char *name,
                                               const ragvit_tensor *t) {
    return tensor_is_float(t->dtype) ? RAGVIT_STATUS_OK : tensor_fail_float(op, name, t);
}

static inline ragvit_status tensor_check_dtype(const char *op, const char *name,
                                               const ragvit_tensor *t, int32_t dtype) {
    return t->dtype == dtype ? RAGVIT_STATUS_OK : tensor_fail_dtype(op, name, t, dtype);
}

static inline ragvit_status tensor_check_same_dtype(const char *op, const char *name,
                                                    const ragvit_tensor *t, const char *ref_name,
                                                    const ragvit_tensor *ref) {
    return t->dtype == ref->dtype ? RAGVIT_STATUS_OK
                                  : tensor_fail_same_dtype(op, name, t, ref_name, ref);
}

static inline ragvit_status tensor_check_last_contiguous(const char *op, const char *name,
                                                         const ragvit_tensor *t) {
    const int32_t last = t->ndim - 1;
    if (last < 0 || t->shape[last] <= 1 || t->strides[last] == 1) return RAGVIT_STATUS_OK;
    return tensor_fail_last_contiguous(op, name, t);
}

static inline ragvit_status tensor_check_writable(const char *op, const char *name,
                                                  const ragvit_tensor *t) {
    return !t->is_read_only ? RAGVIT_STATUS_OK : tensor_fail_writable(op, name, t);
}

/* An output must not reach one element through two indices (an expand()ed or
 * broadcast view: a zero stride on an extent > 1). Inline: each dim's stride is at
 * least the span of the dims after it (row-major, padded rows, column slices);
 * any other layout goes to tensor_check_no_self_overlap_sorted, which orders the
 * dims by |stride| first. Conservative: an interleaving that never truly overlaps
 * may be refused. */
static inline ragvit_status tensor_check_no_self_overlap(const char *op, const char *name,
                                                         const ragvit_tensor *t) {
    int64_t span = 1, reach; /* span: elements spanned by the dims after i */
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] <= 1) continue;
        if (t->strides[i] < span ||
            __builtin_mul_overflow(t->strides[i], t->shape[i] - 1, &reach) ||
            __builtin_add_overflow(span, reach, &span)) {
            return tensor_check_no_self_overlap_sorted(op, name, t);
        }
    }
    return RAGVIT_STATUS_OK;
}

/* out must not share a byte with in (conservative: compares byte extents). */
static inline ragvit_status tensor_check_no_alias(const char *op, const char *name,
                                                  const ragvit_tensor *out, const char *in_name,
                                                  const ragvit_tensor *in) {
    if (!out->is_present || !in->is_present) return RAGVIT_STATUS_OK;
    return tensor_check_no_alias_any(op, name, out, &in_name, &in, 1);
}

/* All present tensors on one CPU or CUDA device; *device_type, *device_id out. */
ragvit_status tensor_check_devices(const char *op, const char *const *names,
                                   const ragvit_tensor *const *tensors, int count,
                                   int32_t *device_type, int32_t *device_id);
/* The row-wise ops (layer_norm, gelu): x (M, C) float, columns contiguous; out (M, C) of
 * x's dtype, columns contiguous, writable; out may be x itself (same row stride)
 * and shares no other byte with x or the present params[i] ((C,) of x's dtype,
 * named param_names[i]; at most 2). All on one device: *device_type, *device_id out. */
ragvit_status tensor_check_rows(const char *op, const ragvit_tensor *out, const ragvit_tensor *x,
                                const char *const *param_names, const ragvit_tensor *const *params,
                                int param_count, int32_t *device_type, int32_t *device_id);
/* cu_seqlens (S+1,) int32 with S+1 >= 1. */
ragvit_status tensor_check_cu_seqlens(const char *op, const ragvit_tensor *cu_seqlens);
/* packed (T, C) float16/bfloat16/float32, channels contiguous, and cu_seqlens as
 * tensor_check_cu_seqlens: the inputs of every op on packed sequences. */
ragvit_status tensor_check_packed(const char *op, const ragvit_tensor *packed,
                                  const ragvit_tensor *cu_seqlens);
/* Host cu_seqlens (S+1,) int32: 0 <= [0], non-decreasing, [S] <= total_tokens,
 * each length <= max_len when max_len >= 0. *longest receives the longest. */
ragvit_status tensor_check_cu_seqlens_host(const char *op, const ragvit_tensor *cu_seqlens,
                                           int64_t total_tokens, int64_t max_len,
                                           const char *max_len_name, int64_t *longest);

#endif /* RAGVIT_TENSOR_H */
