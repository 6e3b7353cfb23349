/* layer_norm.c — the C backend's layer_norm: out (M, C) = (x - mean) / sqrt(var +
 * eps) * weight + bias for every row of x (M, C); weight and bias (C,) optional.
 * Decision: unlike the kernel (float32 statistics), the statistics and the affine
 * map are computed in double and rounded once on store; the host can afford it, and
 * the result then differs from the tests' float64 reference by little more than
 * that one rounding. Covered by tests/test_layer_norm.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <math.h>
#include <stdlib.h>

ragvit_status ragvit_cpu_layer_norm(const ragvit_rowwise_args *a) {
    const int64_t es = dtype_size(a->dtype), C = a->channels;
    if (es == 0) return cpu_fail_dtype("layer_norm", "x", a->dtype);
    float *row = malloc((size_t)(C > 0 ? C : 1) * sizeof *row);
    if (row == NULL) return cpu_fail_scratch("layer_norm", C);
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
