/* cpu_backend.h — the ops in plain C for host tensors, taking the same
 * argument structs as the CUDA launchers (ragvit_args.h). The core has
 * already validated shapes, dtypes and (on the host, where it is cheap)
 * cu_seqlens contents; these functions still stay in bounds on their own.
 * Math is float32 with fp16/bf16 converted in C (round-to-nearest-even). */
#ifndef RAGVIT_CPU_BACKEND_H
#define RAGVIT_CPU_BACKEND_H

#include "ragvit_args.h"

ragvit_status ragvit_cpu_attention(const ragvit_attention_args *a);
ragvit_status ragvit_cpu_pack_count(const ragvit_pack_args *a);
ragvit_status ragvit_cpu_pack_gather(const ragvit_pack_args *a);
ragvit_status ragvit_cpu_unpack(const ragvit_unpack_args *a);
ragvit_status ragvit_cpu_segment_mean(const ragvit_segment_mean_args *a);
ragvit_status ragvit_cpu_linear(const ragvit_linear_args *a);
ragvit_status ragvit_cpu_layer_norm(const ragvit_rowwise_args *a);
ragvit_status ragvit_cpu_gelu(const ragvit_rowwise_args *a);
ragvit_status ragvit_cpu_topk_index(const ragvit_topk_index_args *a);

#endif /* RAGVIT_CPU_BACKEND_H */
