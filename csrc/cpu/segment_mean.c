/* segment_mean.c — the C backend's segment_mean: out[b] (C,) = the mean of rows
 * [cu_seqlens[b] + skip, cu_seqlens[b+1]) of packed (T, C), rounded once to packed's
 * dtype; a zero row for an empty range. Decision: float32 sums in token order times
 * a float 1/count, the arithmetic ragvit_args.h specifies for both backends (not the
 * double of the row ops here); the kernel adds the same rows in four interleaved
 * phases, so the two may differ in the last bits. Covered by tests/test_segment_mean.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <stdlib.h>
#include <string.h>

ragvit_status ragvit_cpu_segment_mean(const ragvit_segment_mean_args *a) {
    const int64_t es = dtype_size(a->dtype), C = a->channels;
    if (es == 0) return cpu_fail_dtype("segment_mean", "packed", a->dtype);
    float *acc = malloc((size_t)(2 * C > 0 ? 2 * C : 1) * sizeof *acc);
    if (acc == NULL) return cpu_fail_scratch("segment_mean", 2 * C);
    float *row = acc + C;
    int is_bad = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t start = a->cu_seqlens[b * a->cu_seqlens_stride];
        const int64_t end = a->cu_seqlens[(b + 1) * a->cu_seqlens_stride];
        int64_t first = start + a->skip, count = 0;
        memset(acc, 0, (size_t)C * sizeof *acc);
        if (!range_is_valid(start, end, a->total_tokens))
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
    if (is_bad) return cpu_fail_cu_seqlens("segment_mean", a->total_tokens);
    return RAGVIT_STATUS_OK;
}
