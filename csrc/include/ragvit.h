/* ragvit.h — the public C API of ragvit's core: status and dtype enums, the
 * ragvit_tensor view, the per-process context and one prototype per op, each in a
 * section named after the core/<op>.c that defines it. Every tensor is a strided view
 * with element strides (DLPack units); shapes use S seqs, T tokens, H heads, D
 * head_dim, C channels, B images, N tokens per padded image, M rows. No Python and no
 * CUDA header is included. Decision: failures return a ragvit_status and leave a
 * formatted message in thread-local storage (ragvit_error_message), so the single
 * place that raises Python exceptions can say which argument was wrong and why. */
#ifndef RAGVIT_H
#define RAGVIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RAGVIT_MAX_DIMS 6
#define RAGVIT_MAX_DEVICES 64

/* What a core function returns; 0 is success. The comments name the Python
 * exception the glue raises for each. */
typedef enum {
    RAGVIT_STATUS_OK = 0,
    RAGVIT_STATUS_INVALID_SHAPE,  /* rank, extent, stride, aliasing -> ValueError */
    RAGVIT_STATUS_INVALID_VALUE,  /* scalar arguments, tensor contents -> ValueError */
    RAGVIT_STATUS_INVALID_DTYPE,  /* -> TypeError */
    RAGVIT_STATUS_INVALID_DEVICE, /* device type/index disagreement -> ValueError */
    RAGVIT_STATUS_NOT_IMPORTABLE, /* unsupported device, lanes, capsule -> BufferError */
    RAGVIT_STATUS_READ_ONLY,      /* output flagged read-only -> ValueError */
    RAGVIT_STATUS_NO_CUDA,        /* CUDA tensor but a CPU-only build -> RuntimeError */
    RAGVIT_STATUS_OUT_OF_MEMORY,  /* -> MemoryError */
    RAGVIT_STATUS_CUDA_ERROR,     /* CUDA runtime failure -> RuntimeError */
    RAGVIT_STATUS_DEVICE_ASSERT,  /* debug flag: a kernel saw bad contents -> ValueError */
    RAGVIT_STATUS_INVALID_TYPE,   /* an argument of the wrong kind of object -> TypeError */
    RAGVIT_STATUS_COUNT
} ragvit_status;

/* Returns the status of x from the enclosing function unless it is OK: the one
 * status-forwarding macro of the core, the C backend and the kernels. */
#define RAGVIT_TRY(x)                                                                              \
    do {                                                                                           \
        ragvit_status s_ = (x);                                                                    \
        if (s_ != RAGVIT_STATUS_OK) return s_;                                                     \
    } while (0)

/* Element types; ops on floats take F16 (IEEE binary16), BF16 (bfloat16) and F32. */
typedef enum {
    RAGVIT_DTYPE_F16 = 0,
    RAGVIT_DTYPE_BF16,
    RAGVIT_DTYPE_F32,
    RAGVIT_DTYPE_I32,
    RAGVIT_DTYPE_I64,
    RAGVIT_DTYPE_U8,
    RAGVIT_DTYPE_BOOL, /* one byte, nonzero = true */
    RAGVIT_DTYPE_F64,
    RAGVIT_DTYPE_COUNT
} ragvit_dtype;

typedef enum {
    RAGVIT_DEVICE_CPU = 1, /* same values as DLPack's kDLCPU / kDLCUDA */
    RAGVIT_DEVICE_CUDA = 2
} ragvit_device_type;

/* A borrowed strided view of a caller's array (the glue fills it from DLPack, the
 * CUDA array interface or NumPy; nothing here owns memory). */
typedef struct {
    /* First element: any byte offset is already applied. */
    void *data;
    /* Extents of the ndim dimensions; entries past ndim are unused. */
    int64_t shape[RAGVIT_MAX_DIMS];
    /* Strides in elements, not bytes (DLPack units), per dimension. */
    int64_t strides[RAGVIT_MAX_DIMS];
    /* Number of dimensions, 0 to RAGVIT_MAX_DIMS. */
    int32_t ndim;
    /* A ragvit_device_type. */
    int32_t device_type;
    /* The device index (0 for the host). */
    int32_t device_id;
    /* A ragvit_dtype. */
    int32_t dtype;
    /* 1 when the producer marked the array read-only (refused as an output). */
    int32_t is_read_only;
    /* 0 for an optional argument the caller left out; every other field is then
     * meaningless. */
    int32_t is_present;
} ragvit_tensor;

/* Bits of the device-side error flag (RAGVIT_DEBUG / ragvit.set_debug). */
#define RAGVIT_ERROR_BAD_CU_SEQLENS 1u  /* negative, decreasing, or past total_tokens */
#define RAGVIT_ERROR_SEQLEN_OVER_MAX 2u /* a length exceeds max_seqlen */
#define RAGVIT_ERROR_CAPACITY 4u        /* packed output smaller than the kept tokens */
#define RAGVIT_ERROR_BAD_INDEX 8u       /* scatter index outside [0, N) */
#define RAGVIT_ERROR_SHORT_SEQ 16u      /* gather_prefix: a sequence shorter than k */

/* Op families for ragvit_device_info.pdl_ops (sm_90+; RAGVIT_PDL overrides, see
 * docs/architecture.md). */
#define RAGVIT_PDL_ATTENTION 1u
#define RAGVIT_PDL_LAYER_NORM 2u
#define RAGVIT_PDL_GELU 4u
#define RAGVIT_PDL_PACK 8u     /* pack, repack, unpack */
#define RAGVIT_PDL_SEGMENT 16u /* segment_mean, topk_index */
#define RAGVIT_PDL_ALL 31u

/* Per-device facts cached on first use: kernels/device.cu fills them, the context
 * keeps them, so no launch queries device properties. */
typedef struct {
    /* 1 once filled; the other fields are meaningless before. */
    int32_t is_initialized;
    /* The CUDA device index these facts describe. */
    int32_t device_id;
    /* Streaming multiprocessors (grid sizing). */
    int32_t sm_count;
    /* Compute capability, major.minor. */
    int32_t cc_major;
    int32_t cc_minor;
    /* Bytes of shared memory a block may opt in to. */
    int64_t smem_per_block_optin;
    /* RAGVIT_PDL_* bits: op families launched with programmatic dependent launch. */
    uint32_t pdl_ops;
    /* Device pointer to one zeroed word that kernels OR RAGVIT_ERROR_* bits into. */
    unsigned int *error_flag;
    /* The stream-ordered memory pool of the outputs ragvit allocates (a cudaMemPool_t),
     * created on the first allocation; NULL before. */
    void *memory_pool;
} ragvit_device_info;

/* Process state owned by the Python module (module state, not a C global). */
typedef struct {
    /* 1: read the device error flag back after every CUDA op (a sync per op). */
    int32_t is_debug;
    /* Indexed by device_id; filled on first use. */
    ragvit_device_info devices[RAGVIT_MAX_DEVICES];
} ragvit_context;

/* ---- core/status.c ---- */
const char *ragvit_status_string(ragvit_status status);
/* Message of the last failure on this thread ("" when none). */
const char *ragvit_error_message(void);
/* Records a formatted message and returns status (for `return ragvit_fail(...)`). */
ragvit_status ragvit_fail(ragvit_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
int ragvit_cuda_is_compiled(void);

/* ---- core/context.c ---- */
void ragvit_context_init(ragvit_context *ctx);
void ragvit_context_release(ragvit_context *ctx);
/* Per-device facts, initialized on first use (CUDA builds only). */
ragvit_status ragvit_context_device(ragvit_context *ctx, int32_t device_id,
                                    const ragvit_device_info **dev);
/* Reads and clears a device's error flag after synchronizing stream; returns
 * RAGVIT_STATUS_DEVICE_ASSERT naming op when any bit was set. */
ragvit_status ragvit_context_check_device(ragvit_context *ctx, int32_t device_id, void *stream,
                                          const char *op);
/* The end of every CUDA op: in debug mode ragvit_context_check_device, else OK. */
ragvit_status ragvit_context_finish(ragvit_context *ctx, int32_t device_id, void *stream,
                                    const char *op);
/* *value = t[index] for t (n,) int32 at any stride, host or device (a device read
 * syncs stream). */
ragvit_status ragvit_read_int32(int32_t *value, const ragvit_tensor *t, int64_t index,
                                void *stream);
ragvit_status ragvit_device_count(int32_t *count);
/* Device index of a CUDA pointer (CAI carries none). */
ragvit_status ragvit_pointer_device(const void *ptr, int32_t *device_id);
/* Launches an empty kernel on stream (the benchmarks' launch-floor row). */
ragvit_status ragvit_launch_empty(ragvit_context *ctx, int32_t device_id, void *stream);
/* Makes `consumer` wait for all work queued so far on `producer` (CAI streams). */
ragvit_status ragvit_stream_wait(int32_t device_id, void *consumer, void *producer);

/* ---- core/memory.c: the memory of outputs ragvit allocates itself ----
 * *data: `bytes` (at least one byte is allocated) on a RAGVIT_DEVICE_* device: host memory
 * aligned to 64 bytes, or CUDA memory allocated in order on `stream` from the device's pool,
 * which keeps freed memory for the next allocation instead of returning it to the driver. */
ragvit_status ragvit_memory_alloc(ragvit_context *ctx, int32_t device_type, int32_t device_id,
                                  size_t bytes, void *stream, void **data);
/* *mark: a new point on `stream` (CUDA) after the work queued on it so far, holding one
 * reference; one call marks every buffer it wrote or read with the same mark (retain it for
 * each). Marks, not streams, order what happens to the memory later: a caller's stream may be
 * destroyed before the memory is freed. Their events come from a per-device pool and return
 * to it when the last reference goes (CUDA builds; a CPU-only build makes no marks). */
ragvit_status ragvit_memory_mark(int32_t device_id, void *stream, void **mark);
void ragvit_memory_mark_retain(void *mark);
void ragvit_memory_mark_release(void *mark);
/* Makes `stream` wait for mark (nothing when mark is NULL). */
ragvit_status ragvit_memory_wait(int32_t device_id, void *stream, void *mark);
/* *stream: a stream of ragvit's own on the device, alive for the process, made to wait for
 * mark (what a CUDA Array Interface consumer synchronizes on). */
ragvit_status ragvit_memory_stream(int32_t device_id, void *mark, void **stream);
/* Frees data (`bytes`, as allocated) from ragvit_memory_alloc once the work before mark is
 * done, in order on ragvit's own stream, and releases the reference to mark (CUDA; without a
 * mark, after the device's work so far; host memory at once). CUDA memory whose mark is on the
 * legacy default stream may instead be kept, with the mark, for the next allocation of the
 * same size on that stream. Needs no context: it may run after the module is gone. */
ragvit_status ragvit_memory_free(int32_t device_type, int32_t device_id, void *data, size_t bytes,
                                 void *mark);
/* Debug counters of a device: events the marks' pool ever created, marks ever recorded, kept
 * blocks ever reused. */
ragvit_status ragvit_memory_stats(int32_t device_id, int64_t *events, int64_t *marks,
                                  int64_t *reused);

/* ---- core/attention.c ----
 * out: (T, H, D) of q's dtype; q, k, v: (T, H, D) float16/bfloat16/float32, head dim
 * contiguous, any token/head strides; cu_seqlens: (S+1,) int32, contiguous;
 * cls_attn: optional (T,) float32, receives each sequence's head-mean probabilities
 * of its first query; bias: optional (T,) float32 added to every logit of key j
 * (ToMe's proportional attention: log(size_j)), finite on the tokens of every
 * sequence (checked on the CPU; on CUDA non-finite values propagate).
 * max_seqlen: upper bound on lengths, or RAGVIT_MAX_SEQLEN_AUTO to derive it
 * (CPU: read from cu_seqlens; CUDA: T, since lengths live on the device);
 * scale: NULL means 1/sqrt(D), otherwise in [FLT_MIN, FLT_MAX / log2(e)] once rounded to
 * float32 (the kernels' dtype). */
#define RAGVIT_MAX_SEQLEN_AUTO INT64_MIN
ragvit_status ragvit_attention(ragvit_context *ctx, const ragvit_tensor *out,
                               const ragvit_tensor *cls_attn, const ragvit_tensor *q,
                               const ragvit_tensor *k, const ragvit_tensor *v,
                               const ragvit_tensor *cu_seqlens, const ragvit_tensor *bias,
                               int64_t max_seqlen, const double *scale, void *stream);

/* ---- core/pack.c: pack, pack_into, unpack, gather_prefix, repack, repack_into ----
 * pack is two calls, count then gather, so the caller can size out from
 * cu_seqlens[B] in between; the _into forms do both into caller-sized buffers,
 * validated once, with no host sync. Kept tokens keep their order; rows past
 * capacity are never written. */
/* pack's count: cu_seqlens_out (B+1,) int32 from keep (B, N) bool/uint8. */
ragvit_status ragvit_pack_count(ragvit_context *ctx, const ragvit_tensor *cu_seqlens_out,
                                const ragvit_tensor *keep, void *stream);
/* pack's gather: out (capacity, C) of x's dtype and optional indices_out (capacity,)
 * int32 (each row's n within its image) from x (B, N, C), keep (B, N) and
 * cu_seqlens (B+1,) int32 as written by the count. */
ragvit_status ragvit_pack_gather(ragvit_context *ctx, const ragvit_tensor *out,
                                 const ragvit_tensor *indices_out, const ragvit_tensor *x,
                                 const ragvit_tensor *keep, const ragvit_tensor *cu_seqlens,
                                 void *stream);
/* pack_into: out (capacity, C), optional indices_out (capacity,) int32 and
 * cu_seqlens_out (B+1,) int32 from x (B, N, C) and keep (B, N) bool/uint8.
 * More kept tokens than capacity: on the host refused before anything is written; on
 * CUDA flagged by the launch (refused in debug mode, after it), when rows and indices
 * [0, capacity) hold the first tokens, nothing past capacity is written and
 * cu_seqlens_out holds the full counts. repack_into alike. */
ragvit_status ragvit_pack_into(ragvit_context *ctx, const ragvit_tensor *out,
                               const ragvit_tensor *indices_out,
                               const ragvit_tensor *cu_seqlens_out, const ragvit_tensor *x,
                               const ragvit_tensor *keep, void *stream);
/* unpack: out (B, N, C) of packed's dtype from packed (T, C) and cu_seqlens (B+1,)
 * int32: row j < len of image b is packed[cu_seqlens[b] + j], or, when indices (T,)
 * int32 is present, packed token t lands at out[b, indices[t]]; every other row is
 * `fill` (inf, -inf or NaN, or finite once rounded to packed's dtype). */
ragvit_status ragvit_unpack(ragvit_context *ctx, const ragvit_tensor *out,
                            const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                            const ragvit_tensor *indices, double fill, void *stream);
/* gather_prefix: out (B, k, C) of packed's dtype from packed (T, C) and cu_seqlens
 * (B+1,) int32: the first k rows of every sequence. Host: a sequence shorter than k
 * is an error (nothing is written). CUDA: its missing rows are zeros and
 * RAGVIT_ERROR_SHORT_SEQ is set. */
ragvit_status ragvit_gather_prefix(ragvit_context *ctx, const ragvit_tensor *out,
                                   const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                   void *stream);
/* repack (multi-stage pruning), count and gather: packed (T, C), cu_seqlens (B+1,)
 * int32 and keep (T,) bool/uint8 over packed rows (rows outside every sequence are
 * ignored). Count: cu_seqlens_out (B+1,) int32 of the kept counts. Gather: out
 * (capacity, C) of packed's dtype and optional src_out (capacity,) int32, the row of
 * packed each out row came from, with cu_seqlens_out as written by the count.
 * fuse_weights, optional (T,) float32 (EViT fusion): each sequence gets one more
 * row after its kept rows, sum(w x) / sum(w) over its dropped rows (zeros when
 * that sum is 0), src -1, counted in cu_seqlens_out. */
ragvit_status ragvit_repack_count(ragvit_context *ctx, const ragvit_tensor *cu_seqlens_out,
                                  const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                  const ragvit_tensor *keep, const ragvit_tensor *fuse_weights,
                                  void *stream);
ragvit_status ragvit_repack_gather(ragvit_context *ctx, const ragvit_tensor *out,
                                   const ragvit_tensor *src_out, const ragvit_tensor *packed,
                                   const ragvit_tensor *cu_seqlens, const ragvit_tensor *keep,
                                   const ragvit_tensor *fuse_weights,
                                   const ragvit_tensor *cu_seqlens_out, void *stream);
/* repack_into: count and gather at once, the tensors as for repack. */
ragvit_status ragvit_repack_into(ragvit_context *ctx, const ragvit_tensor *out,
                                 const ragvit_tensor *src_out, const ragvit_tensor *cu_seqlens_out,
                                 const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                 const ragvit_tensor *keep, const ragvit_tensor *fuse_weights,
                                 void *stream);

/* ---- core/segment_mean.c ----
 * out (B, C) of packed's dtype: the float32-accumulated mean of rows
 * [cu_seqlens[b] + skip, cu_seqlens[b+1]) of packed (T, C), with cu_seqlens (B+1,)
 * int32; zeros for an empty range. skip >= 0. */
ragvit_status ragvit_segment_mean(ragvit_context *ctx, const ragvit_tensor *out,
                                  const ragvit_tensor *packed, const ragvit_tensor *cu_seqlens,
                                  int64_t skip, void *stream);

/* ---- core/linear.c ----
 * out (M, N) = x (M, K) . weight (N, K)^T [+ bias (N,)] [+ residual (M, N)]:
 * nn.Linear on packed rows with an optional residual epilogue. One float dtype for
 * all; unit column strides; bias contiguous; residual may be out itself (in place),
 * nothing else may overlap out. bias/residual: is_present == 0 when absent. */
ragvit_status ragvit_linear(ragvit_context *ctx, const ragvit_tensor *out, const ragvit_tensor *x,
                            const ragvit_tensor *weight, const ragvit_tensor *bias,
                            const ragvit_tensor *residual, void *stream);

/* ---- core/layer_norm.c ----
 * out (M, C) of x's dtype from x (M, C) float16/bfloat16/float32, optional weight
 * and bias (C,) of x's dtype; eps in (0, 1] and >= FLT_MIN once rounded to float32. x and out have
 * unit column strides; out may be x itself (same strides), no other overlap. */
ragvit_status ragvit_layer_norm(ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *x, const ragvit_tensor *weight,
                                const ragvit_tensor *bias, double eps, void *stream);

/* ---- core/gelu.c ----
 * out (M, C) of x's dtype = GELU(x (M, C)), the exact erf form; x is
 * float16/bfloat16/float32. x and out have unit column strides; out may be x itself
 * (same strides), no other overlap. */
ragvit_status ragvit_gelu(ragvit_context *ctx, const ragvit_tensor *out, const ragvit_tensor *x,
                          void *stream);

/* ---- core/topk_index.c ----
 * out (B, prefix + k) int32 or int64, unit column stride: per row of scores
 * (B, L) float16/bfloat16/float32 (unit column stride, any row stride), the
 * columns 0..prefix-1 followed by the k highest-scoring columns of [prefix, L),
 * all in ascending column order. Ranking: score descending, ties keep the
 * lower column, NaN above every number, -0.0 equal to +0.0. 0 <= prefix <= L,
 * 0 <= k <= L - prefix, L <= RAGVIT_TOPK_MAX_COLS (a row's keys fit one
 * block's shared memory). One launch, no host sync, no allocation. */
#define RAGVIT_TOPK_MAX_COLS 8192
ragvit_status ragvit_topk_index(ragvit_context *ctx, const ragvit_tensor *out,
                                const ragvit_tensor *scores, int64_t k, int64_t prefix,
                                void *stream);

/* ---- core/graph_replay.c ----
 * One replay of a captured CUDA graph as a caller sees it, in order on stream: x copied
 * into static_x (the graph's input), the graph launched, each static_outs[i] copied into
 * outs[i]. x and static_x: one shape and dtype, compact (row-major, no gaps); outs[i]
 * and static_outs[i] likewise, for i < count <= RAGVIT_GRAPH_MAX_OUTPUTS; all on one
 * CUDA device. graph_exec: a cudaGraphExec_t instantiated on that device, which reads
 * static_x and writes static_outs (torch.cuda.CUDAGraph.raw_cuda_graph_exec()). Every
 * check runs before anything is queued: a refused call leaves static_x untouched. */
#define RAGVIT_GRAPH_MAX_OUTPUTS 6
ragvit_status ragvit_graph_replay(ragvit_context *ctx, const ragvit_tensor *outs,
                                  const ragvit_tensor *static_x, const ragvit_tensor *x,
                                  const ragvit_tensor *static_outs, int32_t count, void *graph_exec,
                                  void *stream);

#ifdef __cplusplus
}
#endif
#endif /* RAGVIT_H */
