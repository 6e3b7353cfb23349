/* cuda_util.cuh — error plumbing shared by every kernel file: CUDA_TRY turns a
 * cudaError_t into a ragvit_status (message "<name>: <string> (<expr> @
 * <file>:<line>)" recorded by ragvit_cuda_fail; RAGVIT_TRY, from ragvit.h, forwards a status),
 * cuda_device_guard switches to a device for one launcher call, and cuda_launch
 * launches a kernel with programmatic dependent launch (PDL) where the device has
 * it. Decision: a constructor cannot return a status, so the guard does nothing
 * until enter() (used as RAGVIT_TRY(guard.enter(id))); its destructor restores
 * the caller's device on every return path, ignoring errors. */
#ifndef RAGVIT_CUDA_UTIL_CUH
#define RAGVIT_CUDA_UTIL_CUH

/* Kernel files are only ever compiled with nvcc for a CUDA build; make the
 * CUDA half of launch.h visible even if the build forgot the define. */
#ifndef RAGVIT_WITH_CUDA
#define RAGVIT_WITH_CUDA 1
#endif

#include <cuda_runtime.h>

#include "launch.h"

#define CUDA_TRY(x)                                                                                \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) return ragvit_cuda_fail((int)e_, #x, __FILE__, __LINE__);           \
    } while (0)

/* Sets the current device for the lifetime of one launcher call. */
class cuda_device_guard {
  public:
    cuda_device_guard() : previous_(-1) {}
    ~cuda_device_guard() {
        if (previous_ >= 0)
            (void)cudaSetDevice(previous_); /* restoring a device that was current cannot
                                               sensibly fail; nothing to report to */
    }
    cuda_device_guard(const cuda_device_guard &) = delete;
    cuda_device_guard &operator=(const cuda_device_guard &) = delete;

    /* Makes `device` current; cudaSetDevice only when it is not already. */
    ragvit_status enter(int device) {
        int current = 0;
        CUDA_TRY(cudaGetDevice(&current));
        if (current != device) {
            CUDA_TRY(cudaSetDevice(device));
            previous_ = current;
        }
        return RAGVIT_STATUS_OK;
    }

  private:
    int previous_;
};

/* PDL contract. A kernel launched through cuda_launch may be scheduled while the
 * kernel before it on the stream is still finishing, so it must call
 * cuda_pdl_wait() first, before any global load or store: the wait returns once
 * that kernel has completed and its writes are visible (it is a no-op when the
 * launch was a plain one). Every block waits, including blocks that have nothing
 * to do, so the stream order stays transitive. What PDL saves is the launch
 * latency between kernels (block scheduling, parameter setup), most of a batch-1
 * forward's time between kernels. */
static __device__ __forceinline__ void cuda_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when op
 * (a RAGVIT_PDL_* bit) is in dev->pdl_ops. Returns this launch's error, so
 * CUDA_TRY(cuda_launch(...)) is the whole check: no cudaGetLastError after it
 * (which could also report an earlier caller's error as ours). */
template <typename... Params, typename... Args>
static cudaError_t cuda_launch(const ragvit_device_info *dev, unsigned int op,
                               void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, Args &&...args) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = (dev->pdl_ops & op) != 0 ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Args &&>(args)...);
}

#endif /* RAGVIT_CUDA_UTIL_CUH */
