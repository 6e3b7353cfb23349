/* cpu_backend.c — attention, pack/repack, unpack/gather_prefix, segment_mean,
 * linear/layer_norm/gelu and topk_index in plain C for host tensors (the CPU backend and the tests'
 * second opinion), taking kernels/launch.h's structs: element strides, last dim contiguous,
 * fp16/bf16 converted here (nearest even).
 * Decision: each (sequence, head) converts K (transposed to D x L) and V once
 * into float scratch, so every inner loop is a contiguous float axpy that gcc
 * vectorizes without -ffast-math. Contents the core should have rejected are
 * skipped, the in-bounds work is still done, then INVALID_VALUE is returned,
 * as the CUDA kernels write what they can and raise the error flag. */
#include "cpu/cpu_backend.h"
#include "ragvit_topk_key.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MESSAGE_SIZE 256
#define TILE 16 /* floats per register-blocked strip of the attention loops */

/* ---- element conversion ---- */

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1Fu) /* Inf, NaN (payload kept) */
        return bits_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return bits_float(sign);
        /* Subnormal: normalize; 2^-14 is float exponent field 113. */
        uint32_t e = 113;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            e--;
        }
        return bits_float(sign | (e << 23) | ((mantissa & 0x3FFu) << 13));
    }
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t float_to_f16(float f) {
    uint32_t x = float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN: keep the top payload bits, make it quiet */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) /* >= 65520 rounds to Inf (and Inf itself) */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* normal half: rebias 127 -> 15, round at bit 13 */
        uint32_t odd = (ax >> 13) & 1u;
        return (uint16_t)(sign | ((ax - 0x38000000u + 0xFFFu + odd) >> 13));
    }
    /* Subnormal half (or zero): value = m * 2^(e - 150), unit 2^-24. */
    uint32_t e = ax >> 23;
    if (e < 102) /* below 2^-25: rounds to zero */
        return (uint16_t)sign;
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14 .. 24 */
    uint32_t r = m >> shift;
    uint32_t rest = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (r & 1u)))
        r++; /* may carry into the smallest normal, which is the right encoding */
    return (uint16_t)(sign | r);
}

static inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float f) {
    uint32_t x = float_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: keep it quiet and NaN */
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7FFFu + ((x >> 16) & 1u); /* overflow rounds to Inf naturally */
    return (uint16_t)(x >> 16);
}

/* Rounds to float with round-to-odd, so that a second rounding to fp16/bf16
 * (far fewer mantissa bits) equals one correct rounding of the double. */
static float double_to_float_odd(double d) {
    float f = (float)d;
    if (isnan(d) || (double)f == d) return f;
    if (isinf(f)) f = copysignf(FLT_MAX, f);
    uint32_t u = float_bits(f);
    if ((u & 1u) == 0) u = fabs(d) > fabs((double)f) ? u + 1u : u - 1u;
    return bits_float(u);
}

static inline int64_t dtype_size(int32_t dtype) {
    switch (dtype) {
    case RAGVIT_DTYPE_F16:
    case RAGVIT_DTYPE_BF16: return 2;
    case RAGVIT_DTYPE_F32: return 4;
    default: return 0;
    }
}

/* Element i of a row of dtype (F16, BF16, F32). */
static inline float load_elem(const void *row, int64_t i, int32_t dtype) {
    switch (dtype) {
    case RAGVIT_DTYPE_F16: return f16_to_float(((const uint16_t *)row)[i]);
    case RAGVIT_DTYPE_BF16: return bf16_to_float(((const uint16_t *)row)[i]);
    default: return ((const float *)row)[i];
    }
}

static inline void store_elem(void *row, int64_t i, int32_t dtype, float value) {
    switch (dtype) {
    case RAGVIT_DTYPE_F16: ((uint16_t *)row)[i] = float_to_f16(value); break;
    case RAGVIT_DTYPE_BF16: ((uint16_t *)row)[i] = float_to_bf16(value); break;
    default: ((float *)row)[i] = value; break;
    }
}

/* dtype is loop-invariant: gcc -O3 unswitches these into three plain loops. */
static void load_row(float *restrict dst, const void *src, int64_t n, int32_t dtype) {
    for (int64_t i = 0; i < n; i++) dst[i] = load_elem(src, i, dtype);
}

static void store_row(void *dst, const float *restrict src, float factor, int64_t n,
                      int32_t dtype) {
    for (int64_t i = 0; i < n; i++) store_elem(dst, i, dtype, src[i] * factor);
}

static inline int64_t round_up_tile(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

static inline const void *elem_at(const void *base, int64_t index, int64_t size) {
    return (const char *)base + index * size;
}

static inline void *elem_at_mut(void *base, int64_t index, int64_t size) {
    return (char *)base + index * size;
}

/* ---- attention ---- */

/* 1 when sequence s has in-bounds, short-enough contents; otherwise 0, and
 * the reason goes to msg (when not NULL) unless a message is already there. */
static int attention_seq_is_valid(const ragvit_attention_args *a, int32_t s, int64_t *start,
                                  int64_t *end, char *msg) {
    *start = a->cu_seqlens[s];
    *end = a->cu_seqlens[s + 1];
    if (*start < 0 || *end < *start || *end > a->total_tokens) {
        if (msg != NULL && msg[0] == '\0')
            snprintf(msg, MESSAGE_SIZE,
                     "attention: cu_seqlens must be non-decreasing within [0, T=%lld], "
                     "got %lld, %lld at sequence %d",
                     (long long)a->total_tokens, (long long)*start, (long long)*end, (int)s);
        return 0;
    }
    if (*end - *start > a->max_seqlen) {
        if (msg != NULL && msg[0] == '\0')
            snprintf(msg, MESSAGE_SIZE,
                     "attention: every length must be <= max_seqlen=%d, got %lld at sequence %d",
                     (int)a->max_seqlen, (long long)(*end - *start), (int)s);
        return 0;
    }
    return 1;
}

/* One (sequence, head). Scratch: kt (D, lp) with lp = len rounded up to TILE
 * and zero columns past len, vf (len, D), p (lp), qf (D), acc (D). The TILE
 * loops keep their accumulators in vector registers; each output still sums
 * over d (or j) in order, exactly like the plain loop. */
static void attention_seq_head(const ragvit_attention_args *a, int64_t start, int64_t len,
                               int64_t h, float *restrict kt, float *restrict vf, float *restrict p,
                               float *restrict qf, float *restrict acc) {
    const int64_t D = a->head_dim;
    const int64_t lp = round_up_tile(len);
    const int64_t es = dtype_size(a->dtype);
    const int32_t dtype = a->dtype;
    const float *bias = a->bias; /* (T,) or NULL: logit[i][j] += bias[start + j] */

    for (int64_t j = 0; j < len; j++) {
        const int64_t t = start + j;
        const void *krow = elem_at(a->k, t * a->k_stride_token + h * a->k_stride_head, es);
        const void *vrow = elem_at(a->v, t * a->v_stride_token + h * a->v_stride_head, es);
        for (int64_t d = 0; d < D; d++) kt[d * lp + j] = load_elem(krow, d, dtype);
        load_row(vf + j * D, vrow, D, dtype);
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = len; j < lp; j++) kt[d * lp + j] = 0.0f;

    for (int64_t i = 0; i < len; i++) {
        const int64_t t = start + i;
        load_row(qf, elem_at(a->q, t * a->q_stride_token + h * a->q_stride_head, es), D, dtype);

        for (int64_t j0 = 0; j0 < lp; j0 += TILE) {
            float dots[TILE] = {0.0f};
            for (int64_t d = 0; d < D; d++) {
                const float qd = qf[d];
                const float *restrict kd = kt + d * lp + j0;
                for (int u = 0; u < TILE; u++) dots[u] += qd * kd[u];
            }
            for (int u = 0; u < TILE; u++) p[j0 + u] = dots[u];
        }

        float row_max = -INFINITY;
        for (int64_t j = 0; j < len; j++) {
            p[j] *= a->scale;
            if (bias != NULL) /* a separate add: a zero bias leaves p[j] bitwise as it was */
                p[j] += bias[(start + j) * a->bias_stride];
            if (p[j] > row_max) /* NaN logits skip the max but still poison the sum */
                row_max = p[j];
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            p[j] = expf(p[j] - row_max);
            sum += p[j];
        }
        const float inv_sum = 1.0f / sum;

        int64_t d0 = 0;
        for (; d0 + TILE <= D; d0 += TILE) {
            float sums[TILE] = {0.0f};
            for (int64_t j = 0; j < len; j++) {
                const float pj = p[j];
                const float *restrict vj = vf + j * D + d0;
                for (int u = 0; u < TILE; u++) sums[u] += pj * vj[u];
            }
            for (int u = 0; u < TILE; u++) acc[d0 + u] = sums[u];
        }
        for (int64_t d = d0; d < D; d++) {
            float sum_d = 0.0f;
            for (int64_t j = 0; j < len; j++) sum_d += p[j] * vf[j * D + d];
            acc[d] = sum_d;
        }
        store_row(elem_at_mut(a->out, t * a->out_stride_token + h * a->out_stride_head, es), acc,
                  inv_sum, D, dtype);

        if (i == 0 && a->cls_attn != NULL) {
            /* Sum over heads in the output itself, divide at the last head. */
            const int64_t cs = a->cls_attn_stride;
            for (int64_t j = 0; j < len; j++) {
                float *c = a->cls_attn + (start + j) * cs;
                const float prob = p[j] * inv_sum;
                *c = h == 0 ? prob : *c + prob;
                if (h == a->num_heads - 1) *c /= (float)a->num_heads;
            }
        }
    }
}

ragvit_status ragvit_cpu_attention(const ragvit_attention_args *a) {
    char msg[MESSAGE_SIZE] = "";
    if (dtype_size(a->dtype) == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "attention: q must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    if (a->num_seqs <= 0 || a->num_heads <= 0 || a->head_dim < 0) return RAGVIT_STATUS_OK;

    /* Size scratch by the longest valid sequence, not by max_seqlen: the
     * latter is only an upper bound and may be far too generous. */
    int64_t longest = 0;
    for (int32_t s = 0; s < a->num_seqs; s++) {
        int64_t start, end;
        if (attention_seq_is_valid(a, s, &start, &end, msg) && end - start > longest)
            longest = end - start;
    }

    if (longest > 0) {
        const uint64_t D = (uint64_t)a->head_dim;
        const uint64_t L = (uint64_t)round_up_tile(longest);
        const uint64_t limit = SIZE_MAX / sizeof(float);
        if (L > (limit - 2 * D) / (2 * D + 1))
            return ragvit_fail(
                RAGVIT_STATUS_OUT_OF_MEMORY,
                "attention: scratch for a length of %lld with head_dim=%d is too large",
                (long long)longest, (int)a->head_dim);
        const uint64_t count = 2 * L * D + L + 2 * D;
        float *scratch = malloc((size_t)count * sizeof(float));
        if (scratch == NULL)
            return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                               "attention: could not allocate %llu bytes of CPU scratch",
                               (unsigned long long)(count * sizeof(float)));
        float *kt = scratch;
        float *vf = kt + L * D;
        float *p = vf + L * D;
        float *qf = p + L;
        float *acc = qf + D;

        for (int32_t s = 0; s < a->num_seqs; s++) {
            int64_t start, end;
            if (!attention_seq_is_valid(a, s, &start, &end, NULL) || end == start) continue;
            for (int64_t h = 0; h < a->num_heads; h++)
                attention_seq_head(a, start, end - start, h, kt, vf, p, qf, acc);
        }
        free(scratch);
    }

    if (msg[0] != '\0') return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE, "%s", msg);
    return RAGVIT_STATUS_OK;
}

/* ---- pack ---- */

/* Rows [start, start + len) of image b: pack reads all N rows of x[b]; repack
 * reads rows [cu_in[b], cu_in[b+1]) of the packed x, and an image whose range
 * is negative, decreasing or past T is read as empty (returns 0). */
static int pack_image_range(const ragvit_pack_args *a, int64_t b, int64_t *start, int64_t *len) {
    *start = 0;
    *len = a->seqlen;
    if (a->cu_seqlens_in == NULL) return 1;
    const int64_t s = a->cu_seqlens_in[b * a->cu_seqlens_in_stride];
    const int64_t e = a->cu_seqlens_in[(b + 1) * a->cu_seqlens_in_stride];
    if (s < 0 || e < s || e > a->seqlen) {
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

ragvit_status ragvit_cpu_pack_count(const ragvit_pack_args *a) {
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
    a->cu_seqlens[0] = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t start, len;
        is_bad |= !pack_image_range(a, b, &start, &len);
        for (int64_t n = start; n < start + len; n++) total += pack_is_kept(a, b, n);
        total += a->is_fusing; /* the fused token */
        a->cu_seqlens[(b + 1) * a->cu_seqlens_stride] = (int32_t)total;
    }
    if (is_bad)
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "repack: cu_seqlens must be non-decreasing within [0, T=%lld]",
                           (long long)a->seqlen);
    return RAGVIT_STATUS_OK;
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
        if (scratch == NULL)
            return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                               "repack: scratch must be allocatable, got no memory for %lld "
                               "floats",
                               (long long)(2 * a->channels));
    }

    int64_t needed = 0; /* one past the last packed row any image wants */
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t pos = a->cu_seqlens[b * a->cu_seqlens_stride];
        int64_t start, len;
        if (pos < 0) {
            if (msg[0] == '\0')
                snprintf(msg, MESSAGE_SIZE,
                         "pack: cu_seqlens must be non-negative, got %lld at image %lld",
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

    if (needed > a->capacity && msg[0] == '\0')
        snprintf(msg, MESSAGE_SIZE,
                 "pack: out must have room for every kept token (capacity %lld), "
                 "got %lld kept tokens",
                 (long long)a->capacity, (long long)needed);
    if (msg[0] != '\0') return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE, "%s", msg);
    return RAGVIT_STATUS_OK;
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
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "unpack: packed must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
    const int64_t N = a->seqlen, C = a->channels;
    const size_t row_bytes = (size_t)(C * es);

    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t start = a->cu_seqlens[b * a->cu_seqlens_stride];
        const int64_t end = a->cu_seqlens[(b + 1) * a->cu_seqlens_stride];
        int64_t copied = 0; /* rows [0, copied) come from packed (no indices) */
        int64_t len = 0;
        if (start < 0 || end < start || end > a->total_tokens) {
            if (msg[0] == '\0')
                snprintf(msg, MESSAGE_SIZE,
                         "unpack: cu_seqlens must be non-decreasing within [0, T=%lld], "
                         "got %lld, %lld at image %lld",
                         (long long)a->total_tokens, (long long)start, (long long)end,
                         (long long)b);
        } else {
            len = end - start;
            if (a->is_prefix && len < N) {
                if (msg[0] == '\0')
                    snprintf(msg, MESSAGE_SIZE,
                             "gather_prefix: every sequence must have at least k=%lld tokens, "
                             "got length %lld for sequence %lld",
                             (long long)N, (long long)len, (long long)b);
            } else if (a->is_prefix) {
                len = N;
            } else if (len > N) {
                if (msg[0] == '\0')
                    snprintf(msg, MESSAGE_SIZE,
                             "unpack: every length must be <= N=%lld, got %lld at image %lld",
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
                if (msg[0] == '\0')
                    snprintf(msg, MESSAGE_SIZE,
                             "unpack: indices must lie in [0, N=%lld), got %lld at token %lld",
                             (long long)N, (long long)n, (long long)t);
                continue;
            }
            memcpy(elem_at_mut(a->out, b * a->out_stride_b + n * a->out_stride_n, es),
                   elem_at(a->packed, t * a->packed_stride_token, es), row_bytes);
        }
    }

    if (msg[0] != '\0') return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE, "%s", msg);
    return RAGVIT_STATUS_OK;
}

/* ---- segment mean ---- */

ragvit_status ragvit_cpu_segment_mean(const ragvit_segment_mean_args *a) {
    const int64_t es = dtype_size(a->dtype), C = a->channels;
    if (es == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "segment_mean: packed must be float16, bfloat16 or float32, got dtype "
                           "code %d",
                           (int)a->dtype);
    float *acc = malloc((size_t)(2 * C > 0 ? 2 * C : 1) * sizeof *acc);
    if (acc == NULL)
        return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                           "segment_mean: scratch must be allocatable, got no memory for %lld "
                           "floats",
                           (long long)(2 * C));
    float *row = acc + C;
    int is_bad = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t start = a->cu_seqlens[b * a->cu_seqlens_stride];
        const int64_t end = a->cu_seqlens[(b + 1) * a->cu_seqlens_stride];
        int64_t first = start + a->skip, count = 0;
        memset(acc, 0, (size_t)C * sizeof *acc);
        if (start < 0 || end < start || end > a->total_tokens)
            is_bad = 1;
        else if (first < end)
            count = end - first;
        for (int64_t t = first; t < first + count; t++) {
            load_row(row, elem_at(a->packed, t * a->packed_stride_token, es), C, a->dtype);
            for (int64_t c = 0; c < C; c++) acc[c] += row[c];
        }
        store_row(elem_at_mut(a->out, b * a->out_stride_b, es), acc,
                  count > 0 ? 1.0f / (float)count : 0.0f, C, a->dtype);
    }
    free(acc);
    if (is_bad)
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "segment_mean: cu_seqlens must be non-decreasing within [0, T=%lld]",
                           (long long)a->total_tokens);
    return RAGVIT_STATUS_OK;
}

/* ---- linear, layer_norm, gelu (dense per-row ops of a block) ---- */

/* Rounds a double once to dtype (F16/BF16 through a round-to-odd float). */
static void store_elem_double(void *row, int64_t i, int32_t dtype, double value) {
    store_elem(row, i, dtype,
               dtype == RAGVIT_DTYPE_F32 ? (float)value : double_to_float_odd(value));
}

static ragvit_status cpu_scratch_fail(const char *op, int64_t count) {
    return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                       "%s: scratch must be allocatable, got no memory for %lld floats", op,
                       (long long)count);
}

ragvit_status ragvit_cpu_linear(const ragvit_linear_args *a) {
    const int64_t es = dtype_size(a->dtype), M = a->rows, N = a->cols, K = a->inner;
    if (es == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "linear: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    /* weight as float (N, K), one x row as float (K), one output row as double (N) */
    const int64_t floats = N * K + K;
    float *w = malloc((size_t)(floats > 0 ? floats : 1) * sizeof *w);
    double *acc = malloc((size_t)(N > 0 ? N : 1) * sizeof *acc);
    if (w == NULL || acc == NULL) {
        free(w);
        free(acc);
        return cpu_scratch_fail("linear", floats + 2 * N);
    }
    float *xrow = w + N * K;
    for (int64_t n = 0; n < N; n++)
        load_row(w + n * K, elem_at(a->weight, n * a->weight_stride, es), K, a->dtype);
    for (int64_t m = 0; m < M; m++) {
        load_row(xrow, elem_at(a->x, m * a->x_stride, es), K, a->dtype);
        for (int64_t n = 0; n < N; n++) {
            const float *wrow = w + n * K;
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) sum += (double)xrow[k] * (double)wrow[k];
            if (a->bias != NULL) sum += load_elem(a->bias, n * a->bias_stride, a->dtype);
            acc[n] = sum;
        }
        /* residual is read before out is written: residual == out works in place */
        if (a->residual != NULL) {
            const void *rrow = elem_at(a->residual, m * a->residual_stride, es);
            for (int64_t n = 0; n < N; n++) acc[n] += load_elem(rrow, n, a->dtype);
        }
        void *orow = elem_at_mut(a->out, m * a->out_stride, es);
        for (int64_t n = 0; n < N; n++) store_elem_double(orow, n, a->dtype, acc[n]);
    }
    free(w);
    free(acc);
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_cpu_layer_norm(const ragvit_rowwise_args *a) {
    const int64_t es = dtype_size(a->dtype), C = a->channels;
    if (es == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "layer_norm: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    float *row = malloc((size_t)(C > 0 ? C : 1) * sizeof *row);
    if (row == NULL) return cpu_scratch_fail("layer_norm", C);
    for (int64_t m = 0; m < a->rows; m++) {
        load_row(row, elem_at(a->x, m * a->x_stride, es), C, a->dtype);
        double mean = 0.0, var = 0.0;
        for (int64_t c = 0; c < C; c++) mean += row[c];
        mean /= (double)C;
        for (int64_t c = 0; c < C; c++) var += ((double)row[c] - mean) * ((double)row[c] - mean);
        const double rstd = 1.0 / sqrt(var / (double)C + (double)a->eps);
        void *orow = elem_at_mut(a->out, m * a->out_stride, es);
        for (int64_t c = 0; c < C; c++) {
            double y = ((double)row[c] - mean) * rstd;
            if (a->weight != NULL) y *= load_elem(a->weight, c * a->weight_stride, a->dtype);
            if (a->bias != NULL) y += load_elem(a->bias, c * a->bias_stride, a->dtype);
            store_elem_double(orow, c, a->dtype, y);
        }
    }
    free(row);
    return RAGVIT_STATUS_OK;
}

ragvit_status ragvit_cpu_gelu(const ragvit_rowwise_args *a) {
    const int64_t es = dtype_size(a->dtype);
    if (es == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "gelu: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    for (int64_t m = 0; m < a->rows; m++) {
        const void *xrow = elem_at(a->x, m * a->x_stride, es);
        void *orow = elem_at_mut(a->out, m * a->out_stride, es);
        for (int64_t c = 0; c < a->channels; c++) {
            const double v = load_elem(xrow, c, a->dtype);
            store_elem_double(orow, c, a->dtype, 0.5 * v * (1.0 + erf(v * 0.70710678118654752440)));
        }
    }
    return RAGVIT_STATUS_OK;
}

/* ---- topk_index ---- */

typedef struct {
    uint32_t key;
    int32_t column;
} topk_entry;

/* Order-preserving key of a score (topk_key.h, shared with the kernel). */
static inline uint32_t topk_key(float score) { return topk_key_from_bits(float_bits(score)); }

/* qsort order: key descending, then column ascending (a total order, so the
 * result does not depend on the sort's stability). */
static int topk_entry_order(const void *pa, const void *pb) {
    const topk_entry *a = pa, *b = pb;
    if (a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->column > b->column) - (a->column < b->column);
}

ragvit_status ragvit_cpu_topk_index(const ragvit_topk_index_args *a) {
    const int64_t es = dtype_size(a->dtype), L = a->cols, P = a->prefix, k = a->k, n = L - P;
    if (es == 0)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "topk_index: scores must be float16, bfloat16 or float32, got dtype "
                           "code %d",
                           (int)a->dtype);
    if (a->out_dtype != RAGVIT_DTYPE_I32 && a->out_dtype != RAGVIT_DTYPE_I64)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "topk_index: out must be int32 or int64, got dtype code %d",
                           (int)a->out_dtype);
    if (P < 0 || k < 0 || k > n || L > RAGVIT_TOPK_MAX_COLS)
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "topk_index: scores must have L <= %d and 0 <= prefix, k with prefix "
                           "+ k <= L, got L=%lld, prefix=%lld, k=%lld",
                           RAGVIT_TOPK_MAX_COLS, (long long)L, (long long)P, (long long)k);
    topk_entry *entries = malloc((size_t)(n > 0 ? n : 1) * sizeof *entries);
    unsigned char *is_kept = malloc((size_t)(L > 0 ? L : 1));
    if (entries == NULL || is_kept == NULL) {
        free(entries);
        free(is_kept);
        return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                           "topk_index: scratch must be allocatable, got no memory for %lld "
                           "columns",
                           (long long)L);
    }
    for (int64_t b = 0; b < a->batch; b++) {
        memset(is_kept, 1, (size_t)P);
        memset(is_kept + P, k == n, (size_t)n);
        if (k > 0 && k < n) {
            const void *row = elem_at(a->scores, b * a->scores_stride_b, es);
            for (int64_t i = 0; i < n; i++) {
                entries[i].key = topk_key(load_elem(row, P + i, a->dtype));
                entries[i].column = (int32_t)(P + i);
            }
            qsort(entries, (size_t)n, sizeof *entries, topk_entry_order);
            for (int64_t j = 0; j < k; j++) is_kept[entries[j].column] = 1;
        }
        int64_t pos = 0;
        if (a->out_dtype == RAGVIT_DTYPE_I32) {
            int32_t *out = (int32_t *)a->out + b * a->out_stride_b;
            for (int64_t c = 0; c < L; c++)
                if (is_kept[c]) out[pos++] = (int32_t)c;
        } else {
            int64_t *out = (int64_t *)a->out + b * a->out_stride_b;
            for (int64_t c = 0; c < L; c++)
                if (is_kept[c]) out[pos++] = c;
        }
    }
    free(entries);
    free(is_kept);
    return RAGVIT_STATUS_OK;
}
