/* elem.h — the C backend's element handling, shared by every cpu/<op>.c: float16 /
 * bfloat16 / float32 elements to and from float (round to nearest even, NaN kept
 * quiet, done on the bits: no _Float16 or __bf16 needed), and loads and stores of
 * rows, which are unit-stride runs of one dtype addressed by element offsets.
 * Decision: a double goes to float16/bfloat16 through a round-to-odd float
 * (double_to_float_odd), so the ops that accumulate in double (linear, layer_norm,
 * gelu) round once, exactly as a direct conversion of the double would. */
#ifndef RAGVIT_CPU_ELEM_H
#define RAGVIT_CPU_ELEM_H

#include "ragvit.h"

#include <float.h>
#include <math.h>
#include <string.h>

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
        r++; /* may round up to the smallest normal, which is the right encoding */
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
static inline float double_to_float_odd(double d) {
    float f = (float)d;
    if (isnan(d) || (double)f == d) return f;
    if (isinf(f)) f = copysignf(FLT_MAX, f);
    uint32_t u = float_bits(f);
    if ((u & 1u) == 0) u = fabs(d) > fabs((double)f) ? u + 1u : u - 1u;
    return bits_float(u);
}

/* Bytes per element of F16, BF16, F32; 0 for any other dtype. */
static inline int64_t dtype_size(int32_t dtype) {
    switch (dtype) {
    case RAGVIT_DTYPE_F16:
    case RAGVIT_DTYPE_BF16: return 2;
    case RAGVIT_DTYPE_F32: return 4;
    default: return 0;
    }
}

/* ---- elements and rows ---- */

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

/* Rounds a double once to dtype (F16/BF16 through a round-to-odd float). */
static inline void store_elem_double(void *row, int64_t i, int32_t dtype, double value) {
    store_elem(row, i, dtype,
               dtype == RAGVIT_DTYPE_F32 ? (float)value : double_to_float_odd(value));
}

/* dtype is loop-invariant: gcc -O3 unswitches these into three plain loops. */
static inline void load_row(float *restrict dst, const void *src, int64_t n, int32_t dtype) {
    for (int64_t i = 0; i < n; i++) dst[i] = load_elem(src, i, dtype);
}

/* dst[i] = src[i] * factor, rounded to dtype. */
static inline void store_row(void *dst, const float *restrict src, float factor, int64_t n,
                             int32_t dtype) {
    for (int64_t i = 0; i < n; i++) store_elem(dst, i, dtype, src[i] * factor);
}

/* Address of element `index` of an array of `size`-byte elements. */
static inline const void *elem_at(const void *base, int64_t index, int64_t size) {
    return (const char *)base + index * size;
}

static inline void *elem_at_mut(void *base, int64_t index, int64_t size) {
    return (char *)base + index * size;
}

#endif /* RAGVIT_CPU_ELEM_H */
