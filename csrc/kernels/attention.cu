/* attention.cu — ragvit_cuda_attention: softmax attention inside each packed sequence, q, k, v,
 * out (T, H, D) fp16/bf16/fp32 with the head dim contiguous, cu_seqlens (S+1,) int32, optional
 * cls_attn (T,) and per-key bias (T,) fp32. It picks one path: wgmma (attention_wgmma.cu),
 * mma.sync (attention_mma.cu) or fp32 FMA (attention_fma.cu); each launches a grid = (query
 * tiles, H, min(S, 65535)) on the caller's stream. Decision: the choice reads only the arguments
 * and the device facts cached at init (no device query, no allocation per call), and the wgmma
 * path enters it at compile time (RAGVIT_HAS_SM90A) and at run time (supports: cc 9.0).
 * Covered by tests/test_attention.py and dev/test_attention.cu. */
#include "attention.cuh"

// ---- launcher ----

/* Opts the tensor-core kernels in to the dynamic shared memory of their largest plans (the
 * FMA kernels use static shared memory only). */
extern "C" ragvit_status attention_init(const ragvit_device_info *dev) {
    RAGVIT_TRY(attention_mma_init(dev));
#ifdef RAGVIT_HAS_SM90A
    RAGVIT_TRY(attention_wgmma_init(dev));
#endif
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_attention(const ragvit_attention_args *a,
                                               const ragvit_device_info *dev, void *stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    if (a->num_seqs <= 0 || a->total_tokens <= 0 || a->num_heads <= 0) return RAGVIT_STATUS_OK;
    ragvit_attention_args args = *a;
    if (!(args.scale > 0.0f)) /* ragvit.h: <= 0 or NaN means 1/sqrt(D) */
        args.scale = 1.0f / sqrtf((float)args.head_dim);
    const cudaStream_t s = (cudaStream_t)stream;
    /* fp16/bf16 with 16-byte aligned rows run on tensor cores (cls_attn and bias included);
     * of those, D = 64 without cls_attn or bias on a cc 9.0 device runs on wgmma. */
    if (attention_mma_supports(&args, dev)) {
#ifdef RAGVIT_HAS_SM90A
        if (attention_wgmma_supports(&args, dev)) return attention_wgmma_launch(&args, dev, s);
#endif
        return attention_mma_launch(&args, dev, s);
    }
    return attention_fma_launch(&args, dev, s);
}
