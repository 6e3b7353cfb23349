/* workbench.h — host helpers the workbench's GPU checks share (test_attention.cu,
 * fused_block.cu): CHECK_CUDA, and fp16 / bf16 values as their 16-bit patterns and back
 * (dtype RAGVIT_DTYPE_F16 or RAGVIT_DTYPE_BF16; rounded to nearest even through float). */
#ifndef RAGVIT_DEV_WORKBENCH_H
#define RAGVIT_DEV_WORKBENCH_H

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ragvit.h"

/* A CUDA runtime call that must succeed: else the call, its error and the line, and exit 2. */
#define CHECK_CUDA(x)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__,       \
                    __LINE__);                                                                     \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static uint16_t to_bits(double x, int dtype) {
    if (dtype == RAGVIT_DTYPE_F16) {
        const __half_raw r = __float2half_rn((float)x);
        return r.x;
    }
    const __nv_bfloat16_raw r = __float2bfloat16_rn((float)x);
    return r.x;
}

static double from_bits(uint16_t u, int dtype) {
    if (dtype == RAGVIT_DTYPE_F16) {
        __half_raw r;
        r.x = u;
        return (double)__half2float(__half(r));
    }
    __nv_bfloat16_raw r;
    r.x = u;
    return (double)__bfloat162float(__nv_bfloat16(r));
}

#endif /* RAGVIT_DEV_WORKBENCH_H */
