/* gelu.c — the C backend's gelu: out (M, C) = x * Phi(x), the exact erf form, for
 * every row of x (M, C); out may be x itself (each element is read, then written).
 * Decision: each element is computed in double (erf) and rounded once on store, so
 * the result differs from the tests' float64 reference by little more than that.
 * Covered by tests/test_gelu.py. */
#include "cpu/cpu_backend.h"
#include "cpu/elem.h"
#include "cpu/fail.h"

#include <math.h>

ragvit_status ragvit_cpu_gelu(const ragvit_rowwise_args *a) {
    const int64_t es = dtype_size(a->dtype);
    if (es == 0) return cpu_fail_dtype("gelu", "x", a->dtype);
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
