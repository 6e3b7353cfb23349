/* launch.h — the CUDA launchers the core calls: extern "C" functions that take an
 * argument struct (ragvit_args.h), the device's cached facts and the stream as
 * void *, so host C never sees a CUDA header. Every launcher sets the device named
 * by dev->device_id for the call, restores the caller's device, launches on
 * `stream` and reports launch failures through CUDA_TRY (cuda_util.cuh). Declared
 * only in CUDA builds (RAGVIT_WITH_CUDA). */
#ifndef RAGVIT_LAUNCH_H
#define RAGVIT_LAUNCH_H

#include "ragvit_args.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef RAGVIT_WITH_CUDA
/* ---- device state (device.cu) ---- */
/* Number of visible devices; 0 (and OK) when there is no driver or device. */
ragvit_status ragvit_cuda_device_count(int32_t *count);
/* Fills info once per device: SM count, compute capability, opt-in shared
 * memory, a zeroed one-word error flag; also runs each kernel file's one-time
 * setup (cudaFuncSetAttribute) so launches never do it. */
ragvit_status ragvit_cuda_device_init(int32_t device_id, ragvit_device_info *info);
void ragvit_cuda_device_release(ragvit_device_info *info);
/* Synchronizes stream, reads *flag into *value and zeroes it. */
ragvit_status ragvit_cuda_read_error_flag(const ragvit_device_info *dev, void *stream,
                                          unsigned int *value);
ragvit_status ragvit_cuda_read_int32(int32_t device_id, const int32_t *src, void *stream,
                                     int32_t *value);
/* Device that owns a device pointer (cudaPointerGetAttributes). */
ragvit_status ragvit_cuda_pointer_device(const void *ptr, int32_t *device_id);
ragvit_status ragvit_cuda_stream_wait(int32_t device_id, void *consumer, void *producer);
/* Stream-ordered allocation from dev's pool (created on first use) and its free. */
ragvit_status ragvit_cuda_memory_alloc(ragvit_device_info *dev, size_t bytes, void *stream,
                                       void **data);
ragvit_status ragvit_cuda_memory_free(int32_t device_id, void *data, size_t bytes, void *mark);
/* Marks (pooled events, reference counted) on a stream, waits on them, the device's own stream
 * and the pool's counters (memory.c). */
ragvit_status ragvit_cuda_memory_mark(int32_t device_id, void *stream, void **mark);
void ragvit_cuda_memory_mark_retain(void *mark);
void ragvit_cuda_memory_mark_release(void *mark);
ragvit_status ragvit_cuda_memory_stats(int32_t device_id, int64_t *events, int64_t *marks,
                                       int64_t *reused);
ragvit_status ragvit_cuda_memory_wait(int32_t device_id, void *stream, void *mark);
ragvit_status ragvit_cuda_memory_stream(int32_t device_id, void *mark, void **stream);
/* Records a CUDA failure's string and expression; used by CUDA_TRY. */
ragvit_status ragvit_cuda_fail(int error, const char *expr, const char *file, int line);

/* Launches an empty kernel (the benchmarks' launch-floor row). */
ragvit_status ragvit_cuda_launch_empty(const ragvit_device_info *dev, void *stream);

/* ---- ops (one file each) ---- */
ragvit_status ragvit_cuda_attention(const ragvit_attention_args *a, const ragvit_device_info *dev,
                                    void *stream);
ragvit_status ragvit_cuda_pack_count(const ragvit_pack_args *a, const ragvit_device_info *dev,
                                     void *stream);
ragvit_status ragvit_cuda_pack_gather(const ragvit_pack_args *a, const ragvit_device_info *dev,
                                      void *stream);
/* count + gather in one launch: writes cu_seqlens and the rows (the _into forms). */
ragvit_status ragvit_cuda_pack_into(const ragvit_pack_args *a, const ragvit_device_info *dev,
                                    void *stream);
ragvit_status ragvit_cuda_unpack(const ragvit_unpack_args *a, const ragvit_device_info *dev,
                                 void *stream);
ragvit_status ragvit_cuda_segment_mean(const ragvit_segment_mean_args *a,
                                       const ragvit_device_info *dev, void *stream);
ragvit_status ragvit_cuda_linear(const ragvit_linear_args *a, const ragvit_device_info *dev,
                                 void *stream);
ragvit_status ragvit_cuda_layer_norm(const ragvit_rowwise_args *a, const ragvit_device_info *dev,
                                     void *stream);
ragvit_status ragvit_cuda_gelu(const ragvit_rowwise_args *a, const ragvit_device_info *dev,
                               void *stream);
ragvit_status ragvit_cuda_topk_index(const ragvit_topk_index_args *a, const ragvit_device_info *dev,
                                     void *stream);
/* Copy in, graph launch, copies out (cudaMemcpyAsync, cudaGraphLaunch): no kernel of ragvit's. */
ragvit_status ragvit_cuda_graph_replay(const ragvit_graph_replay_args *a,
                                       const ragvit_device_info *dev, void *stream);
#endif

#ifdef __cplusplus
}
#endif
#endif /* RAGVIT_LAUNCH_H */
