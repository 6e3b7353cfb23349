/* attention.c — the C backend's ragged attention: for each sequence s and head h,
 * softmax(scale q k^T + bias) v over tokens [cu_seqlens[s], cu_seqlens[s+1]), with
 * q, k, v, out (T, H, D) at element strides (head dim contiguous) and the optional
 * head-mean probabilities of each sequence's first query into cls_attn (T,).
 * Decision: each (sequence, head) converts K (transposed to D x L) and V once into
 * float scratch, so every inner loop is a contiguous float axpy that gcc vectorizes
 * without -ffast-math. Covered by tests/test_attention.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <math.h>
#include <stdlib.h>

#define TILE 16 /* floats per register-blocked strip of the attention loops */

static inline int64_t round_up_tile(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

/* 1 when sequence s has in-bounds, short-enough contents; otherwise 0, with the
 * reason noted in msg (note_problem; NULL notes nothing). */
static int attention_seq_is_valid(const ragvit_attention_args *a, int32_t s, int64_t *start,
                                  int64_t *end, char *msg) {
    *start = a->cu_seqlens[s];
    *end = a->cu_seqlens[s + 1];
    if (!range_is_valid(*start, *end, a->total_tokens)) {
        note_problem(msg,
                     "attention: cu_seqlens must be non-decreasing within [0, T=%lld], "
                     "got %lld, %lld at sequence %d",
                     (long long)a->total_tokens, (long long)*start, (long long)*end, (int)s);
        return 0;
    }
    if (*end - *start > a->max_seqlen) {
        note_problem(msg,
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
    if (dtype_size(a->dtype) == 0) return cpu_fail_dtype("attention", "q", a->dtype);
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

    return problem_status(msg);
}
