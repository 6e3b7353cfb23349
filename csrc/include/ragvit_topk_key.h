/* ragvit_topk_key.h — the order-preserving key of a topk_index score, one definition
 * for the C backend (cpu/topk_index.c) and the kernel (kernels/topk_index.cu), so
 * both rank scores bit for bit alike: key(a) > key(b) iff a > b, every NaN above
 * +inf (as torch.topk ranks it), -0.0 equal to +0.0. It works on the float's bits,
 * so no compiler flag can fold the -0.0 case. Plain C; nvcc sees a host-and-device
 * function. */
#ifndef RAGVIT_TOPK_KEY_H
#define RAGVIT_TOPK_KEY_H

#include <stdint.h>

#ifdef __CUDACC__
#define RAGVIT_TOPK_KEY_FN static __host__ __device__ __forceinline__
#else
#define RAGVIT_TOPK_KEY_FN static inline
#endif

/* bits: the IEEE-754 binary32 bits of the score (a float16/bfloat16 score widened first). */
RAGVIT_TOPK_KEY_FN uint32_t topk_key_from_bits(uint32_t bits) {
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
    if ((bits & 0x7FFFFFFFu) == 0) bits = 0;
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

#endif /* RAGVIT_TOPK_KEY_H */
