/* tensor.c — pure-C checks on ragvit_tensor views: rank, shape, element
 * strides, dtype, device agreement, writability, aliasing (between tensors and of
 * an output with itself), and the contents of host-side cu_seqlens. Messages follow "<op>: <arg>
 * must be <rule>, got <actual>" so every front end reports the same words. Decision: the alias
 * check compares byte extents, which may refuse exotic interleaved views that
 * do not truly overlap; refusing is safe, silently racing is not. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "core/tensor.h"

static const char *const dtype_names[RAGVIT_DTYPE_COUNT] = {
    [RAGVIT_DTYPE_F16] = "float16", [RAGVIT_DTYPE_BF16] = "bfloat16",
    [RAGVIT_DTYPE_F32] = "float32", [RAGVIT_DTYPE_I32] = "int32",
    [RAGVIT_DTYPE_I64] = "int64",   [RAGVIT_DTYPE_U8] = "uint8",
    [RAGVIT_DTYPE_BOOL] = "bool",   [RAGVIT_DTYPE_F64] = "float64",
};

const char *tensor_dtype_name(int32_t dtype) {
    if (dtype < 0 || dtype >= RAGVIT_DTYPE_COUNT) return "unknown";
    return dtype_names[dtype];
}

/* "(2, 3, 4)" into buf. */
static const char *format_shape(char *buf, size_t size, int32_t ndim, const int64_t *shape) {
    size_t used = 0;
    used += (size_t)snprintf(buf + used, size - used, "(");
    for (int32_t i = 0; i < ndim && used < size; i++) {
        used += (size_t)snprintf(buf + used, size - used, "%s%" PRId64, i ? ", " : "", shape[i]);
    }
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
    return buf;
}

ragvit_status tensor_fail_ndim(const char *op, const char *name, const ragvit_tensor *t,
                               int32_t ndim) {
    char got[128];
    return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE, "%s: %s must have %d dimensions, got %d %s", op,
                       name, ndim, t->ndim, format_shape(got, sizeof got, t->ndim, t->shape));
}

ragvit_status tensor_fail_shape(const char *op, const char *name, const ragvit_tensor *t,
                                int32_t ndim, const int64_t *shape) {
    char want[128], got[128];
    format_shape(want, sizeof want, ndim, shape);
    for (char *c = strstr(want, "-1"); c; c = strstr(c, "-1")) memcpy(c, " *", 2);
    return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE, "%s: %s must have shape %s, got %s", op, name,
                       want, format_shape(got, sizeof got, t->ndim, t->shape));
}

ragvit_status tensor_fail_float(const char *op, const char *name, const ragvit_tensor *t) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                       "%s: %s must be float16, bfloat16 or float32, got %s", op, name,
                       tensor_dtype_name(t->dtype));
}

ragvit_status tensor_fail_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                int32_t dtype) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE, "%s: %s must be %s, got %s", op, name,
                       tensor_dtype_name(dtype), tensor_dtype_name(t->dtype));
}

ragvit_status tensor_fail_same_dtype(const char *op, const char *name, const ragvit_tensor *t,
                                     const char *ref_name, const ragvit_tensor *ref) {
    return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE, "%s: %s must have the dtype of %s (%s), got %s",
                       op, name, ref_name, tensor_dtype_name(ref->dtype),
                       tensor_dtype_name(t->dtype));
}

ragvit_status tensor_fail_last_contiguous(const char *op, const char *name,
                                          const ragvit_tensor *t) {
    const int32_t last = t->ndim - 1;
    return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                       "%s: %s must be contiguous in its last dimension (stride 1), got stride "
                       "%" PRId64,
                       op, name, t->strides[last]);
}

ragvit_status tensor_fail_writable(const char *op, const char *name, const ragvit_tensor *t) {
    (void)t;
    return ragvit_fail(RAGVIT_STATUS_READ_ONLY, "%s: %s must be writable, got a read-only array",
                       op, name);
}

ragvit_status tensor_check_no_self_overlap_sorted(const char *op, const char *name,
                                                  const ragvit_tensor *t) {
    int64_t stride[RAGVIT_MAX_DIMS], extent[RAGVIT_MAX_DIMS];
    int32_t n = 0;
    for (int32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) return RAGVIT_STATUS_OK; /* no element at all */
        if (t->shape[i] == 1) continue;
        const int64_t s = t->strides[i] < 0 ? -t->strides[i] : t->strides[i];
        int32_t j = n++; /* insertion sort by |stride|: at most RAGVIT_MAX_DIMS dims */
        for (; j > 0 && stride[j - 1] > s; j--) {
            stride[j] = stride[j - 1];
            extent[j] = extent[j - 1];
        }
        stride[j] = s;
        extent[j] = t->shape[i];
    }
    int64_t span = 1, reach;
    int32_t i = 0;
    for (; i < n && stride[i] >= span; i++) { /* past INT64_MAX: no larger stride fits */
        if (__builtin_mul_overflow(stride[i], extent[i] - 1, &reach) ||
            __builtin_add_overflow(span, reach, &span)) {
            span = INT64_MAX;
        }
    }
    if (i == n) return RAGVIT_STATUS_OK;
    char shape[128], strides[128];
    return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                       "%s: %s must not overlap itself, got shape %s with strides %s", op, name,
                       format_shape(shape, sizeof shape, t->ndim, t->shape),
                       format_shape(strides, sizeof strides, t->ndim, t->strides));
}

/* [lo, hi) byte range touched by t; empty when any extent is 0. */
static int byte_extent(const ragvit_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t first = 0, last = 0;
    for (int32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) return 0;
        int64_t span = (t->shape[i] - 1) * t->strides[i];
        if (span < 0)
            first += span;
        else
            last += span;
    }
    int64_t size = tensor_dtype_size(t->dtype);
    *lo = (uintptr_t)t->data + (uintptr_t)(first * size);
    *hi = (uintptr_t)t->data + (uintptr_t)((last + 1) * size);
    return 1;
}

ragvit_status tensor_check_no_alias_any(const char *op, const char *name, const ragvit_tensor *out,
                                        const char *const *names, const ragvit_tensor *const *ins,
                                        int count) {
    uintptr_t out_lo, out_hi, in_lo, in_hi;
    if (!out->is_present || !byte_extent(out, &out_lo, &out_hi)) return RAGVIT_STATUS_OK;
    for (int i = 0; i < count; i++) {
        const ragvit_tensor *in = ins[i];
        if (!in->is_present || in->device_type != out->device_type ||
            in->device_id != out->device_id || !byte_extent(in, &in_lo, &in_hi) ||
            out_hi <= in_lo || in_hi <= out_lo) {
            continue;
        }
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must not alias (overlap) %s, got overlapping memory", op, name,
                           names[i]);
    }
    return RAGVIT_STATUS_OK;
}

static const char *device_name(int32_t type) {
    return type == RAGVIT_DEVICE_CPU ? "cpu" : type == RAGVIT_DEVICE_CUDA ? "cuda" : "other";
}

ragvit_status tensor_check_devices(const char *op, const char *const *names,
                                   const ragvit_tensor *const *tensors, int count,
                                   int32_t *device_type, int32_t *device_id) {
    const ragvit_tensor *ref = NULL;
    const char *ref_name = NULL;
    for (int i = 0; i < count; i++) {
        const ragvit_tensor *t = tensors[i];
        if (!t->is_present) continue;
        if (t->device_type != RAGVIT_DEVICE_CPU && t->device_type != RAGVIT_DEVICE_CUDA) {
            return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                               "%s: %s must be on a CPU or CUDA device, got device type %d", op,
                               names[i], t->device_type);
        }
        if (!ref) {
            ref = t;
            ref_name = names[i];
            continue;
        }
        if (t->device_type != ref->device_type || t->device_id != ref->device_id) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_DEVICE,
                               "%s: %s must be on the device of %s (%s:%d), got %s:%d", op,
                               names[i], ref_name, device_name(ref->device_type), ref->device_id,
                               device_name(t->device_type), t->device_id);
        }
    }
    *device_type = ref ? ref->device_type : RAGVIT_DEVICE_CPU;
    *device_id = ref ? ref->device_id : 0;
    return RAGVIT_STATUS_OK;
}

ragvit_status tensor_check_cu_seqlens(const char *op, const ragvit_tensor *cu_seqlens) {
    RAGVIT_TRY(tensor_check_ndim(op, "cu_seqlens", cu_seqlens, 1));
    RAGVIT_TRY(tensor_check_dtype(op, "cu_seqlens", cu_seqlens, RAGVIT_DTYPE_I32));
    if (cu_seqlens->shape[0] >= 1) return RAGVIT_STATUS_OK;
    return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                       "%s: cu_seqlens must have num_seqs+1 >= 1 entries, got 0", op);
}

ragvit_status tensor_check_packed(const char *op, const ragvit_tensor *packed,
                                  const ragvit_tensor *cu_seqlens) {
    RAGVIT_TRY(tensor_check_ndim(op, "packed", packed, 2));
    RAGVIT_TRY(tensor_check_float(op, "packed", packed));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "packed", packed));
    return tensor_check_cu_seqlens(op, cu_seqlens);
}

ragvit_status tensor_check_cu_seqlens_host(const char *op, const ragvit_tensor *cu_seqlens,
                                           int64_t total_tokens, int64_t max_len,
                                           const char *max_len_name, int64_t *longest) {
    const int32_t *cu = (const int32_t *)cu_seqlens->data;
    int64_t stride = cu_seqlens->strides[0];
    int64_t num_seqs = cu_seqlens->shape[0] - 1;
    int64_t best = 0;
    if (cu[0] < 0) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: cu_seqlens[0] must be >= 0, got %" PRId32, op, cu[0]);
    }
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t start = cu[s * stride], end = cu[(s + 1) * stride];
        if (end < start) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: cu_seqlens must be non-decreasing, got cu_seqlens[%" PRId64
                               "]=%" PRId64 " > cu_seqlens[%" PRId64 "]=%" PRId64,
                               op, s, start, s + 1, end);
        }
        if (max_len >= 0 && end - start > max_len) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                               "%s: cu_seqlens lengths must be <= %s (%" PRId64
                               "), got length %" PRId64 " for sequence %" PRId64,
                               op, max_len_name, max_len, end - start, s);
        }
        if (end - start > best) best = end - start;
    }
    int64_t last = cu[num_seqs * stride];
    if (last > total_tokens) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "%s: cu_seqlens[-1] must be <= total_tokens (%" PRId64 "), got %" PRId64,
                           op, total_tokens, last);
    }
    if (longest) *longest = best;
    return RAGVIT_STATUS_OK;
}

ragvit_status tensor_check_rows(const char *op, const ragvit_tensor *out, const ragvit_tensor *x,
                                const char *const *param_names, const ragvit_tensor *const *params,
                                int param_count, int32_t *device_type, int32_t *device_id) {
    const char *names[4] = {"x"}; /* x, the params, out: the order devices are named */
    const ragvit_tensor *all[4] = {x};
    RAGVIT_TRY(tensor_check_ndim(op, "x", x, 2));
    RAGVIT_TRY(tensor_check_float(op, "x", x));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "x", x));
    const int64_t M = x->shape[0], C = x->shape[1];
    const int64_t shape[2] = {M, C}, vec[1] = {C};
    RAGVIT_TRY(tensor_check_shape(op, "out", out, 2, shape));
    RAGVIT_TRY(tensor_check_same_dtype(op, "out", out, "x", x));
    RAGVIT_TRY(tensor_check_last_contiguous(op, "out", out));
    RAGVIT_TRY(tensor_check_writable(op, "out", out));
    RAGVIT_TRY(tensor_check_no_self_overlap(op, "out", out));
    for (int i = 0; i < param_count; i++) {
        names[1 + i] = param_names[i];
        all[1 + i] = params[i];
        if (!params[i]->is_present) continue;
        RAGVIT_TRY(tensor_check_shape(op, param_names[i], params[i], 1, vec));
        RAGVIT_TRY(tensor_check_same_dtype(op, param_names[i], params[i], "x", x));
    }
    names[1 + param_count] = "out";
    all[1 + param_count] = out;
    RAGVIT_TRY(tensor_check_devices(op, names, all, 2 + param_count, device_type, device_id));
    if (out->data == x->data && M > 1 && C > 0) {
        if (out->strides[0] != x->strides[0]) {
            return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                               "%s: out must have x's row stride when it is x (in place), got "
                               "%lld and %lld",
                               op, (long long)out->strides[0], (long long)x->strides[0]);
        }
    } else if (out->data != x->data) {
        RAGVIT_TRY(tensor_check_no_alias(op, "out", out, "x", x));
    }
    for (int i = 0; i < param_count; i++) {
        RAGVIT_TRY(tensor_check_no_alias(op, "out", out, param_names[i], params[i]));
    }
    return RAGVIT_STATUS_OK;
}
