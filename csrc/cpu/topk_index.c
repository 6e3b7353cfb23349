/* topk_index.c — the C backend's topk_index: for each row of scores (B, L), the
 * columns 0..prefix-1 followed by the k highest-scoring columns of [prefix, L), all
 * in ascending column order, into out (B, prefix + k) int32 or int64. Decision: a
 * qsort by the key of ragvit_topk_key.h (one definition with the kernel), then by
 * column: a total order, so the choice does not depend on the sort's stability.
 * Covered by tests/test_topk_index.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"
#include "ragvit_topk_key.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    uint32_t key;
    int32_t column;
} topk_entry;

/* Order-preserving key of a score (ragvit_topk_key.h, shared with the kernel). */
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
    if (es == 0) return cpu_fail_dtype("topk_index", "scores", a->dtype);
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
