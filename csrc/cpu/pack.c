/* pack.c — the C backend's pack family, split as in core/pack.c and kernels/pack.cu:
 * count (keep (B, N) -> cu_seqlens (B+1,)) and gather (x (B, N, C) -> out
 * (capacity, C) and indices_out), which repack runs with image b read from rows
 * [cu_seqlens_in[b], cu_seqlens_in[b+1]) of a packed x and the EViT fused token
 * appended; and unpack (packed (T, C) -> out (B, N, C), by position or by indices;
 * gather_prefix is unpack of the first k rows). Rows move as bytes, so the result is
 * exact. Decision: rows past capacity are counted, never written, and the call
 * reports the room it needed. Covered by tests/test_pack.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <stdlib.h>
#include <string.h>

/* Rows [start, start + len) of image b: pack reads all N rows of x[b]; repack
 * reads rows [cu_in[b], cu_in[b+1]) of the packed x, and an image whose range
 * is negative, decreasing or past T is read as empty (returns 0). */
static int pack_image_range(const ragvit_pack_args *a, int64_t b, int64_t *start, int64_t *len) {
    *start = 0;
    *len = a->seqlen;
    if (a->cu_seqlens_in == NULL) return 1;
    const int64_t s = a->cu_seqlens_in[b * a->cu_seqlens_in_stride];
    const int64_t e = a->cu_seqlens_in[(b + 1) * a->cu_seqlens_in_stride];
    if (!range_is_valid(s, e, a->seqlen)) {
        *len = 0;
        return 0;
    }
    *start = s;
    *len = e - s;
    return 1;
}

static inline int pack_is_kept(const ragvit_pack_args *a, int64_t b, int64_t n) {
    return a->keep[b * a->keep_stride_b + n * a->keep_stride_n] != 0;
}

/* Counts kept tokens (and fused tokens) per image into cu (stride cu_stride) when
 * cu is not NULL; *total receives the sum. */
static ragvit_status pack_count(const ragvit_pack_args *a, int32_t *cu, int64_t cu_stride,
                                int64_t *total_out) {
    if (a->batch < 0 || a->seqlen < 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "pack: x must have non-negative B and N, got B=%lld, N=%lld",
                           (long long)a->batch, (long long)a->seqlen);
    if (a->cu_seqlens_in == NULL && a->seqlen > 0 && a->batch > INT32_MAX / a->seqlen)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "pack: x must hold at most 2^31-1 tokens (B*N) for int32 cu_seqlens, "
                           "got B=%lld, N=%lld",
                           (long long)a->batch, (long long)a->seqlen);

    int64_t total = 0;
    int is_bad = 0;
    if (cu != NULL) cu[0] = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t start, len;
        is_bad |= !pack_image_range(a, b, &start, &len);
        for (int64_t n = start; n < start + len; n++) total += pack_is_kept(a, b, n);
        total += a->is_fusing; /* the fused token */
        if (cu != NULL) cu[(b + 1) * cu_stride] = (int32_t)total;
    }
    if (is_bad) return cpu_fail_cu_seqlens("repack", a->seqlen);
    *total_out = total;
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_cpu_pack_count(const ragvit_pack_args *a) {
    int64_t total = 0;
    return pack_count(a, a->cu_seqlens, a->cu_seqlens_stride, &total);
}

ragvit_status ragvit_cpu_pack_total(const ragvit_pack_args *a, int64_t *total) {
    return pack_count(a, NULL, 0, total);
}

/* The fused token of image b's rows [start, start + len): sum(w x) / sum(w)
 * over its dropped rows in float32 (zeros when sum(w) == 0), into out_row.
 * acc and row are C floats of scratch. */
static void pack_fuse_row(const ragvit_pack_args *a, int64_t b, int64_t start, int64_t len,
                          void *out_row, float *acc, float *row) {
    const int64_t C = a->channels;
    float weight_sum = 0.0f;
    memset(acc, 0, (size_t)C * sizeof *acc);
    for (int64_t n = start; n < start + len; n++) {
        if (pack_is_kept(a, b, n)) continue;
        const float w = a->fuse_weights[n * a->fuse_weights_stride];
        weight_sum += w;
        load_row(row, elem_at(a->x, b * a->x_stride_b + n * a->x_stride_n, a->elem_size), C,
                 a->dtype);
        for (int64_t c = 0; c < C; c++) acc[c] += w * row[c];
    }
    for (int64_t c = 0; c < C; c++) acc[c] = weight_sum != 0.0f ? acc[c] / weight_sum : 0.0f;
    store_row(out_row, acc, 1.0f, C, a->dtype);
}

ragvit_status ragvit_cpu_pack_gather(const ragvit_pack_args *a) {
    char msg[MESSAGE_SIZE] = "";
    const int64_t es = a->elem_size;
    if (es <= 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "pack: x must have 2- or 4-byte elements, got %d bytes",
                           (int)a->elem_size);
    const size_t row_bytes = (size_t)(a->channels * es);
    float *scratch = NULL; /* 2 C floats for the fused token */
    if (a->is_fusing) {
        scratch = malloc((size_t)(a->channels > 0 ? 2 * a->channels : 1) * sizeof *scratch);
        if (scratch == NULL) return cpu_fail_scratch("repack", 2 * a->channels);
    }

    int64_t needed = 0; /* one past the last packed row any image wants */
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t pos = a->cu_seqlens[b * a->cu_seqlens_stride];
        int64_t start, len;
        if (pos < 0) {
            note_problem(msg, "pack: cu_seqlens must be non-negative, got %lld at image %lld",
                         (long long)pos, (long long)b);
            continue;
        }
        pack_image_range(a, b, &start, &len);
        for (int64_t n = start; n < start + len; n++) {
            if (!pack_is_kept(a, b, n)) continue;
            if (pos < a->capacity) {
                memcpy(elem_at_mut(a->out, pos * a->out_stride_token, es),
                       elem_at(a->x, b * a->x_stride_b + n * a->x_stride_n, es), row_bytes);
                if (a->indices_out != NULL) a->indices_out[pos * a->indices_stride] = (int32_t)n;
            }
            pos++;
        }
        if (scratch != NULL) {
            if (pos < a->capacity) {
                pack_fuse_row(a, b, start, len, elem_at_mut(a->out, pos * a->out_stride_token, es),
                              scratch, scratch + a->channels);
                if (a->indices_out != NULL) a->indices_out[pos * a->indices_stride] = -1;
            }
            pos++;
        }
        if (pos > needed) needed = pos;
    }
    free(scratch);

    if (needed > a->capacity)
        note_problem(msg,
                     "pack: out must have room for every kept token (capacity %lld), "
                     "got %lld kept tokens",
                     (long long)a->capacity, (long long)needed);
    return problem_status(msg);
}

/* ---- unpack ---- */

/* Stores `count` copies of one element whose bit pattern is `bits`. */
static void unpack_fill_row(void *row, int64_t count, int64_t es, uint32_t bits) {
    if (es == 4) {
        uint32_t *r = row;
        for (int64_t c = 0; c < count; c++) r[c] = bits;
    } else {
        uint16_t *r = row;
        for (int64_t c = 0; c < count; c++) r[c] = (uint16_t)bits;
    }
}

ragvit_status ragvit_cpu_unpack(const ragvit_unpack_args *a) {
    char msg[MESSAGE_SIZE] = "";
    const int64_t es = dtype_size(a->dtype);
    uint32_t fill_bits;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: fill_bits = float_to_f16(double_to_float_odd(a->fill)); break;
    case RAGVIT_DTYPE_BF16: fill_bits = float_to_bf16(double_to_float_odd(a->fill)); break;
    case RAGVIT_DTYPE_F32: fill_bits = float_bits((float)a->fill); break;
    default: return cpu_fail_dtype("unpack", "packed", a->dtype);
    }
    const int64_t N = a->seqlen, C = a->channels;
    const size_t row_bytes = (size_t)(C * es);

    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t start = a->cu_seqlens[b * a->cu_seqlens_stride];
        const int64_t end = a->cu_seqlens[(b + 1) * a->cu_seqlens_stride];
        int64_t copied = 0; /* rows [0, copied) come from packed (no indices) */
        int64_t len = 0;
        if (!range_is_valid(start, end, a->total_tokens)) {
            note_problem(msg,
                         "unpack: cu_seqlens must be non-decreasing within [0, T=%lld], "
                         "got %lld, %lld at image %lld",
                         (long long)a->total_tokens, (long long)start, (long long)end,
                         (long long)b);
        } else {
            len = end - start;
            if (a->is_prefix && len < N) {
                note_problem(msg,
                             "gather_prefix: every sequence must have at least k=%lld tokens, "
                             "got length %lld for sequence %lld",
                             (long long)N, (long long)len, (long long)b);
            } else if (a->is_prefix) {
                len = N;
            } else if (len > N) {
                note_problem(msg, "unpack: every length must be <= N=%lld, got %lld at image %lld",
                             (long long)N, (long long)len, (long long)b);
                len = N;
            }
            if (a->indices == NULL) copied = len;
        }

        for (int64_t j = 0; j < copied; j++)
            memcpy(elem_at_mut(a->out, b * a->out_stride_b + j * a->out_stride_n, es),
                   elem_at(a->packed, (start + j) * a->packed_stride_token, es), row_bytes);
        for (int64_t j = copied; j < N; j++)
            unpack_fill_row(elem_at_mut(a->out, b * a->out_stride_b + j * a->out_stride_n, es), C,
                            es, fill_bits);

        if (a->indices == NULL) continue;
        for (int64_t t = start; t < start + len; t++) {
            const int64_t n = a->indices[t * a->indices_stride];
            if (n < 0 || n >= N) {
                note_problem(msg, "unpack: indices must lie in [0, N=%lld), got %lld at token %lld",
                             (long long)N, (long long)n, (long long)t);
                continue;
            }
            memcpy(elem_at_mut(a->out, b * a->out_stride_b + n * a->out_stride_n, es),
                   elem_at(a->packed, t * a->packed_stride_token, es), row_bytes);
        }
    }

    return problem_status(msg);
}
