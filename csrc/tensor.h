/* tensor.h — pure-C checks on ragvit_tensor views shared by every op's host
 * side (attention.c, pack.c). Each check returns RAGVIT_STATUS_OK or fails
 * through ragvit_fail with "<op>: <name> must be <rule>, got <actual>". */
#ifndef RAGVIT_TENSOR_H
#define RAGVIT_TENSOR_H

#include "ragvit.h"

#define TRY(x)                                   \
    do {                                         \
        ragvit_status s_ = (x);                  \
        if (s_ != RAGVIT_STATUS_OK) return s_;   \
    } while (0)

const char *tensor_dtype_name(int32_t dtype);
int32_t tensor_dtype_size(int32_t dtype);
int tensor_is_float(int32_t dtype); /* F16, BF16, F32 */

ragvit_status tensor_check_ndim(const char *op, const char *name, const ragvit_tensor *t,
                                int32_t ndim);
/* Extent -1 in `shape` matches anything. */
ragvit_status tensor_check_shape(const char *op, const char *name, const ragvit_tensor *t,
                                 int32_t ndim, const int64_t *shape);
ragvit_status tensor_check_float(const char *op, const char *name, const ragvit_tensor *t);
ragvit_status tensor_check_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                 int32_t dtype);
ragvit_status tensor_check_same_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                      const char *ref_name, const ragvit_tensor *ref);
ragvit_status tensor_check_last_contiguous(const char *op, const char *name,
                                           const ragvit_tensor *t);
ragvit_status tensor_check_writable(const char *op, const char *name, const ragvit_tensor *t);
/* out must not share a byte with in (conservative: compares byte extents). */
ragvit_status tensor_check_no_alias(const char *op, const char *name, const ragvit_tensor *out,
                                    const char *in_name, const ragvit_tensor *in);
/* All present tensors on one CPU or CUDA device; *device_type, *device_id out. */
ragvit_status tensor_check_devices(const char *op, const char *const *names,
                                   const ragvit_tensor *const *tensors, int count,
                                   int32_t *device_type, int32_t *device_id);
/* packed (T, C) float16/bfloat16/float32, channels contiguous, and cu_seqlens
 * (S+1,) int32 with S+1 >= 1: the inputs of every op on packed sequences. */
ragvit_status tensor_check_packed(const char *op, const ragvit_tensor *packed,
                                  const ragvit_tensor *cu_seqlens);
/* Host cu_seqlens (S+1,) int32: 0 <= [0], non-decreasing, [S] <= total_tokens,
 * each length <= max_len when max_len >= 0. *longest receives the longest. */
ragvit_status tensor_check_cu_seqlens_host(const char *op, const ragvit_tensor *cu_seqlens,
                                           int64_t total_tokens, int64_t max_len,
                                           const char *max_len_name, int64_t *longest);

#endif /* RAGVIT_TENSOR_H */
