/* dependent_launch.cuh — programmatic dependent launch (PDL, sm_90+) for the row ops
 * and attention, the kernels that sit between two cuBLASLt GEMMs in a transformer block.
 * A kernel launched by dependent_launch() may be scheduled as soon as every block of the
 * kernel before it in the stream has exited, instead of after that kernel's completion
 * has been signalled; it must call dependent_launch_wait() before its first global
 * memory access, which returns once the previous kernel has completed and its writes are
 * visible. So the launch latency of a short kernel overlaps the tail of the GEMM before
 * it (in a CUDA graph, a stream capture turns the attribute into a programmatic edge).
 * Decision: the wait comes first in every such kernel, even before loads of data the
 * previous kernel cannot have written (weights), because the op cannot know that. On
 * devices below sm_90 the attribute is not set and the wait compiles to nothing. */
#ifndef RAGVIT_DEPENDENT_LAUNCH_CUH
#define RAGVIT_DEPENDENT_LAUNCH_CUH

#include <cuda_runtime.h>

#include <utility>

#include "launch.h"

/* Returns once the kernel before this one in the stream has completed (no-op when the
 * launch was not dependent, or below sm_90). */
static __device__ __forceinline__ void dependent_launch_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/* Whether launches on this device may be dependent (compute capability >= 9.0; never in
 * a build with -DRAGVIT_NO_DEPENDENT_LAUNCH, the A/B switch for measuring it). */
static inline bool dependent_launch_supported(const ragvit_device_info *dev) {
#ifdef RAGVIT_NO_DEPENDENT_LAUNCH
    (void)dev;
    return false;
#else
    return dev != nullptr && dev->cc_major >= 9;
#endif
}

/* kernel<<<grid, block, smem, stream>>>(args...), dependent on the previous kernel in the
 * stream when is_dependent (see dependent_launch_supported). */
template <typename... Params, typename... Args>
static cudaError_t dependent_launch(bool is_dependent, void (*kernel)(Params...), dim3 grid,
                                    dim3 block, size_t smem, cudaStream_t stream,
                                    Args &&...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = is_dependent ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

#endif /* RAGVIT_DEPENDENT_LAUNCH_CUH */
