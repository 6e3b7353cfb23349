/* linear.c — the C backend's linear: out (M, N) = x (M, K) . weight (N, K)^T
 * [+ bias (N,)] [+ residual (M, N)], unit column strides, any row strides; residual
 * may be out itself (each residual row is read before its out row is written).
 * Decision: weight is converted to float once; each dot product and the bias and
 * residual adds accumulate in double and round once on store. The host can afford
 * it, and the result then differs from the tests' float64 reference by little more
 * than that one rounding. Covered by tests/test_linear.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <stdlib.h>

ragvit_status ragvit_cpu_linear(const ragvit_linear_args *a) {
    const int64_t es = dtype_size(a->dtype), M = a->rows, N = a->cols, K = a->inner;
    if (es == 0) return cpu_fail_dtype("linear", "x", a->dtype);
    /* weight as float (N, K), one x row as float (K), one output row as double (N) */
    const int64_t floats = N * K + K;
    float *w = malloc((size_t)(floats > 0 ? floats : 1) * sizeof *w);
    double *acc = malloc((size_t)(N > 0 ? N : 1) * sizeof *acc);
    if (w == NULL || acc == NULL) {
        free(w);
        free(acc);
        return cpu_fail_scratch("linear", floats + 2 * N);
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
