/* cpu_backend.h — the C backend: every op in plain C for host tensors, one file per op
 * (cpu/<op>.c, named after core/<op>.c), taking the same argument structs as the
 * CUDA launchers (ragvit_args.h). The core has already validated shapes, dtypes and
 * (on the host, where it is cheap) cu_seqlens contents; these functions still stay
 * in bounds on their own. fp16/bf16 are converted in C (cpu/elem.h). Decision: the
 * pack family (pack, repack, unpack, gather_prefix) shares cpu/pack.c, as it shares
 * core/pack.c and kernels/pack.cu. */
#ifndef RAGVIT_CPU_BACKEND_H
#define RAGVIT_CPU_BACKEND_H

#include "ragvit_args.h"

ragvit_status ragvit_cpu_attention(const ragvit_attention_args *a);
ragvit_status ragvit_cpu_pack_count(const ragvit_pack_args *a);
/* The total ragvit_cpu_pack_count would write at cu_seqlens[B], writing nothing: the
 * _into forms check capacity with it before any output is touched. */
ragvit_status ragvit_cpu_pack_total(const ragvit_pack_args *a, int64_t *total);
ragvit_status ragvit_cpu_pack_gather(const ragvit_pack_args *a);
ragvit_status ragvit_cpu_unpack(const ragvit_unpack_args *a);
ragvit_status ragvit_cpu_segment_mean(const ragvit_segment_mean_args *a);
ragvit_status ragvit_cpu_linear(const ragvit_linear_args *a);
ragvit_status ragvit_cpu_layer_norm(const ragvit_rowwise_args *a);
ragvit_status ragvit_cpu_gelu(const ragvit_rowwise_args *a);
ragvit_status ragvit_cpu_topk_index(const ragvit_topk_index_args *a);

#endif /* RAGVIT_CPU_BACKEND_H */
