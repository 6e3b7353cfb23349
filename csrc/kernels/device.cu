/* device.cu — per-device state and the small host helpers every op shares: device count,
 * one-time device init (SM count, compute capability, opt-in shared memory, the PDL op mask, the
 * one-word error flag), error-flag and int32 read-back, cross-stream waits, the stream-ordered
 * memory pool of the outputs ragvit allocates, the CUDA error -> ragvit_status mapping, and an
 * empty kernel for the launch-floor benchmark (grid = (1), 1 thread, launched as attention is:
 * cudaLaunchKernelEx with attention's PDL setting, waiting like it).
 * Decision: the error flag is a __device__ word, zero when the module loads, so init allocates
 * nothing and a first call inside graph capture works (the pool, too, waits for the first
 * allocation); every function that touches a device sets it for the call and restores the
 * caller's. Covered by tests/test_interop.py (devices, streams, the launch floor),
 * tests/test_array_types.py (allocation) and the debug-mode error-flag cases of each op's tests. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_util.cuh"

/* One-time per-device setup of the attention kernels (cudaFuncSetAttribute), in attention.cu;
 * hidden there as here (attention.cuh), so the module does not export it. */
extern "C" __attribute__((visibility("hidden"))) ragvit_status
attention_init(const ragvit_device_info *dev);

// ---- kernels ----

/* RAGVIT_ERROR_* bits that kernels OR in (one word per device). */
static __device__ unsigned int device_error_flag;

static __global__ void device_empty_kernel() { cuda_pdl_wait(); }

// ---- host helpers ----

/* Short file name for messages: the build passes absolute paths. */
static const char *device_basename(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

/* RAGVIT_PDL: unset, the default set; else a RAGVIT_PDL_* mask in decimal or 0x hex
 * (0: plain launches everywhere), for A/B timing and debugging. */
static unsigned int device_pdl_ops() {
    const char *env = getenv("RAGVIT_PDL");
    if (env == NULL || *env == '\0') return RAGVIT_PDL_ALL;
    char *end = NULL;
    const unsigned long mask = strtoul(env, &end, 0);
    return *end == '\0' ? (unsigned int)mask & RAGVIT_PDL_ALL : RAGVIT_PDL_ALL;
}

// ---- launcher ----

extern "C" ragvit_status ragvit_cuda_fail(int error, const char *expr, const char *file, int line) {
    const cudaError_t e = (cudaError_t)error;
    /* Clears the non-sticky last-error state so the next CUDA_TRY(cudaGetLastError())
     * does not report this failure a second time (sticky errors stay). */
    (void)cudaGetLastError();
    const ragvit_status status =
        e == cudaErrorMemoryAllocation ? RAGVIT_STATUS_OUT_OF_MEMORY : RAGVIT_STATUS_CUDA_ERROR;
    return ragvit_fail(status, "%s: %s (%s @ %s:%d)", cudaGetErrorName(e), cudaGetErrorString(e),
                       expr, device_basename(file), line);
}

extern "C" ragvit_status ragvit_cuda_device_count(int32_t *count) {
    int n = 0;
    *count = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        (void)cudaGetLastError();
        return RAGVIT_STATUS_OK;
    }
    CUDA_TRY(e);
    *count = (int32_t)n;
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_device_init(int32_t device_id, ragvit_device_info *info) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));

    int sm_count = 0, cc_major = 0, cc_minor = 0, smem_optin = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device_id));
    CUDA_TRY(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device_id));
    CUDA_TRY(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device_id));
    CUDA_TRY(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id));

    ragvit_device_info filled;
    memset(&filled, 0, sizeof filled);
    filled.device_id = device_id;
    filled.sm_count = sm_count;
    filled.cc_major = cc_major;
    filled.cc_minor = cc_minor;
    filled.smem_per_block_optin = smem_optin;
    filled.pdl_ops = cc_major >= 9 ? device_pdl_ops() : 0;

    /* A __device__ word is zero when the module loads on each device: no
     * cudaMalloc/cudaMemset here, so a first call inside graph capture works. */
    void *flag = NULL;
    CUDA_TRY(cudaGetSymbolAddress(&flag, device_error_flag));
    filled.error_flag = (unsigned int *)flag;

    RAGVIT_TRY(attention_init(&filled));

    filled.is_initialized = 1; /* published last: a half-filled info never looks valid */
    *info = filled;
    return RAGVIT_STATUS_OK;
}

extern "C" void ragvit_cuda_device_release(ragvit_device_info *info) {
    /* The flag is a module global: nothing to free. A pool with live allocations is destroyed
     * by CUDA once the last of them is freed, so buffers may outlive the module. */
    if (info->memory_pool != NULL) (void)cudaMemPoolDestroy((cudaMemPool_t)info->memory_pool);
    memset(info, 0, sizeof *info);
}

extern "C" ragvit_status ragvit_cuda_read_error_flag(const ragvit_device_info *dev, void *stream,
                                                     unsigned int *value) {
    *value = 0;
    if (!dev->is_initialized || dev->error_flag == NULL)
        return ragvit_fail(RAGVIT_STATUS_CUDA_ERROR,
                           "ragvit: device %d must be initialized before reading its error flag",
                           (int)dev->device_id);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    unsigned int bits = 0;
    CUDA_TRY(cudaStreamSynchronize(s));
    CUDA_TRY(cudaMemcpyAsync(&bits, dev->error_flag, sizeof bits, cudaMemcpyDeviceToHost, s));
    CUDA_TRY(cudaStreamSynchronize(s));
    if (bits != 0) {
        /* Synchronized so that the next op, whatever its stream, sees 0. */
        CUDA_TRY(cudaMemsetAsync(dev->error_flag, 0, sizeof(unsigned int), s));
        CUDA_TRY(cudaStreamSynchronize(s));
    }
    *value = bits;
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_read_int32(int32_t device_id, const int32_t *src, void *stream,
                                                int32_t *value) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    int32_t host = 0;
    CUDA_TRY(cudaMemcpyAsync(&host, src, sizeof host, cudaMemcpyDeviceToHost, s));
    CUDA_TRY(cudaStreamSynchronize(s));
    *value = host;
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_pointer_device(const void *ptr, int32_t *device_id) {
    cudaPointerAttributes attr;
    CUDA_TRY(cudaPointerGetAttributes(&attr, ptr));
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                           "ragvit: CUDA Array Interface data must be device memory, got a %s "
                           "pointer",
                           attr.type == cudaMemoryTypeHost ? "pinned host" : "host");
    *device_id = (int32_t)attr.device;
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_stream_wait(int32_t device_id, void *consumer,
                                                 void *producer) {
    if (consumer == producer) return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    cudaEvent_t event = NULL;
    CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    /* The event is destroyed on every path; destruction is deferred by CUDA
     * until the wait has been satisfied. */
    cudaError_t e = cudaEventRecord(event, (cudaStream_t)producer);
    const char *expr = "cudaEventRecord(event, producer)";
    if (e == cudaSuccess) {
        e = cudaStreamWaitEvent((cudaStream_t)consumer, event, 0);
        expr = "cudaStreamWaitEvent(consumer, event, 0)";
    }
    const cudaError_t destroyed = cudaEventDestroy(event);
    if (e != cudaSuccess) return ragvit_cuda_fail((int)e, expr, __FILE__, __LINE__);
    CUDA_TRY(destroyed);
    return RAGVIT_STATUS_OK;
}

/* A pool of its own rather than the device's default one: its release threshold keeps freed
 * memory for the next call (the default pool's threshold 0 hands it back to the driver at
 * each synchronization), without changing the default pool other libraries share. */
static ragvit_status device_create_pool(int32_t device_id, cudaMemPool_t *pool) {
    int is_supported = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&is_supported, cudaDevAttrMemoryPoolsSupported, device_id));
    if (!is_supported)
        return ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "ragvit: out must be given on CUDA device %d, got none (the device "
                           "has no stream-ordered memory pools for ragvit to allocate from)",
                           (int)device_id);
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_id;
    CUDA_TRY(cudaMemPoolCreate(pool, &props));
    uint64_t threshold = UINT64_MAX;
    const cudaError_t e =
        cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    if (e != cudaSuccess) {
        (void)cudaMemPoolDestroy(*pool);
        *pool = NULL;
        return ragvit_cuda_fail((int)e, "cudaMemPoolSetAttribute(pool, ReleaseThreshold)", __FILE__,
                                __LINE__);
    }
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_memory_alloc(ragvit_device_info *dev, size_t bytes,
                                                  void *stream, void **data) {
    *data = NULL;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    if (dev->memory_pool == NULL) {
        cudaMemPool_t pool = NULL;
        RAGVIT_TRY(device_create_pool(dev->device_id, &pool));
        dev->memory_pool = (void *)pool;
    }
    CUDA_TRY(cudaMallocFromPoolAsync(data, bytes, (cudaMemPool_t)dev->memory_pool,
                                     (cudaStream_t)stream));
    return RAGVIT_STATUS_OK;
}

/* ragvit's own stream per device, created on first use and kept for the process: frees are
 * ordered there, after the mark of the memory's last known use, never on a caller's stream,
 * which may be destroyed by the time the memory goes. */
static pthread_mutex_t device_stream_lock = PTHREAD_MUTEX_INITIALIZER;
static cudaStream_t device_streams[RAGVIT_MAX_DEVICES];

static ragvit_status device_own_stream(int32_t device_id, cudaStream_t *stream) {
    if (device_id < 0 || device_id >= RAGVIT_MAX_DEVICES)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DEVICE, "ragvit: device must be < %d, got %d",
                           RAGVIT_MAX_DEVICES, (int)device_id);
    pthread_mutex_lock(&device_stream_lock);
    cudaError_t e = cudaSuccess;
    if (device_streams[device_id] == NULL)
        e = cudaStreamCreateWithFlags(&device_streams[device_id], cudaStreamNonBlocking);
    *stream = device_streams[device_id];
    pthread_mutex_unlock(&device_stream_lock);
    if (e != cudaSuccess)
        return ragvit_cuda_fail((int)e, "cudaStreamCreateWithFlags(stream, NonBlocking)", __FILE__,
                                __LINE__);
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_memory_mark(int32_t device_id, void *stream, void **mark) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    if (*mark == NULL)
        CUDA_TRY(cudaEventCreateWithFlags((cudaEvent_t *)mark, cudaEventDisableTiming));
    CUDA_TRY(cudaEventRecord((cudaEvent_t)*mark, (cudaStream_t)stream));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_memory_wait(int32_t device_id, void *stream, void *mark) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)mark, 0));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_memory_stream(int32_t device_id, void *mark, void **stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    cudaStream_t own = NULL;
    RAGVIT_TRY(device_own_stream(device_id, &own));
    if (mark != NULL) CUDA_TRY(cudaStreamWaitEvent(own, (cudaEvent_t)mark, 0));
    *stream = (void *)own;
    return RAGVIT_STATUS_OK;
}

/* Without a mark (a buffer dropped before its call marked it) the device's work so far is
 * waited for. The event is destroyed at once: CUDA defers that until the wait is met. At exit
 * the runtime may be unloading: the process frees everything. */
extern "C" ragvit_status ragvit_cuda_memory_free(int32_t device_id, void *data, void *mark) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    cudaStream_t own = NULL;
    RAGVIT_TRY(device_own_stream(device_id, &own));
    cudaError_t e =
        mark != NULL ? cudaStreamWaitEvent(own, (cudaEvent_t)mark, 0) : cudaDeviceSynchronize();
    if (mark != NULL) (void)cudaEventDestroy((cudaEvent_t)mark);
    if (e == cudaSuccess) e = cudaFreeAsync(data, own);
    if (e == cudaSuccess || e == cudaErrorCudartUnloading) return RAGVIT_STATUS_OK;
    return ragvit_cuda_fail((int)e, "cudaFreeAsync(data, stream)", __FILE__, __LINE__);
}

extern "C" ragvit_status ragvit_cuda_launch_empty(const ragvit_device_info *dev, void *stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, device_empty_kernel, dim3(1), dim3(1), 0,
                         (cudaStream_t)stream));
    return RAGVIT_STATUS_OK;
}
