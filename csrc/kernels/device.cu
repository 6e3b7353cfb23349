/* device.cu — per-device state and the small host helpers every op shares: device count,
 * one-time device init (SM count, compute capability, opt-in shared memory, the PDL op mask, the
 * one-word error flag), error-flag and int32 read-back, cross-stream waits, the stream-ordered
 * memory pool of the outputs ragvit allocates with the pooled events (marks) that order their
 * frees and the blocks kept for reuse on the legacy default stream, the CUDA error ->
 * ragvit_status mapping, and an
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

// ---- marks: pooled events and ragvit's own stream ----

/* A mark: one event recorded on one stream after a call's launches, shared by every buffer
 * that call wrote or read (refs counts them). Events are created on demand and never
 * destroyed: a released mark returns to its device's free list and a later call records it
 * again, with no query: a cudaStreamWaitEvent already enqueued keeps the state the event had
 * when it was enqueued, whatever is recorded afterwards. So the pool holds as many events as
 * marks were ever alive at once. */
struct device_mark {
    cudaEvent_t event;
    void *stream; /* the stream it was recorded on (kept blocks: see device_block_take) */
    int32_t device_id;
    int refs;          /* atomic: the buffers (and the marking call) that hold it */
    uint64_t serial;   /* this record, unique per device: see device_own_wait */
    device_mark *next; /* the free list */
};

/* A freed block of pool memory kept, with the mark of its last use (one reference), for the
 * next allocation of the same size on the legacy default stream. */
struct device_block {
    void *data;
    size_t bytes;
    device_mark *mark;
};

/* Kept blocks per device, and the largest size kept: at most 64 MiB held out of the pool. Host
 * time matters for small outputs; large ones go back to the pool. */
#define DEVICE_BLOCK_COUNT 16
#define DEVICE_BLOCK_MAX_BYTES ((size_t)4 << 20)

/* Per device, under device_lock: the free marks, ragvit's own stream (created on first use
 * and kept for the process; frees are ordered there, after the mark of the memory's last known
 * use, never on a caller's stream, which may be destroyed by the time the memory goes), the
 * serial of the mark that stream last waited on, the kept blocks, and counters for the tests. */
struct device_event_state {
    device_mark *free_marks;
    cudaStream_t own;
    uint64_t own_waited;
    uint64_t next_serial;
    device_block blocks[DEVICE_BLOCK_COUNT]; /* oldest first */
    int block_count;
    int64_t created;  /* events created */
    int64_t recorded; /* marks recorded */
    int64_t reused;   /* allocations served by a kept block */
};

static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;
static device_event_state device_events[RAGVIT_MAX_DEVICES];

static ragvit_status device_check_id(int32_t device_id) {
    if (device_id >= 0 && device_id < RAGVIT_MAX_DEVICES) return RAGVIT_STATUS_OK;
    return ragvit_fail(RAGVIT_STATUS_INVALID_DEVICE, "ragvit: device must be < %d, got %d",
                       RAGVIT_MAX_DEVICES, (int)device_id);
}

static void device_mark_release(device_mark *mark) {
    if (__atomic_sub_fetch(&mark->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    pthread_mutex_lock(&device_lock);
    mark->next = device_events[mark->device_id].free_marks;
    device_events[mark->device_id].free_marks = mark;
    pthread_mutex_unlock(&device_lock);
}

/* *mark (one reference): a free mark of the device (a new event when none is free) recorded
 * on stream. The device must be current. */
static ragvit_status device_mark_record(int32_t device_id, void *stream, device_mark **mark) {
    *mark = NULL;
    RAGVIT_TRY(device_check_id(device_id));
    device_event_state *state = &device_events[device_id];
    pthread_mutex_lock(&device_lock);
    device_mark *m = state->free_marks;
    if (m != NULL) state->free_marks = m->next;
    pthread_mutex_unlock(&device_lock);
    if (m == NULL) {
        m = (device_mark *)calloc(1, sizeof *m);
        if (m == NULL)
            return ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY, "ragvit: cannot allocate a mark");
        const cudaError_t e = cudaEventCreateWithFlags(&m->event, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            free(m);
            return ragvit_cuda_fail((int)e, "cudaEventCreateWithFlags(event, DisableTiming)",
                                    __FILE__, __LINE__);
        }
        m->device_id = device_id;
        pthread_mutex_lock(&device_lock);
        state->created++;
        pthread_mutex_unlock(&device_lock);
    }
    m->refs = 1;
    m->stream = stream;
    const cudaError_t e = cudaEventRecord(m->event, (cudaStream_t)stream);
    pthread_mutex_lock(&device_lock);
    if (e == cudaSuccess) {
        m->serial = ++state->next_serial;
        state->recorded++;
    } else {
        m->next = state->free_marks;
        state->free_marks = m;
    }
    pthread_mutex_unlock(&device_lock);
    if (e != cudaSuccess)
        return ragvit_cuda_fail((int)e, "cudaEventRecord(event, stream)", __FILE__, __LINE__);
    *mark = m;
    return RAGVIT_STATUS_OK;
}

/* *own: the device's own stream, made to wait on mark (none when NULL) unless it already
 * waited on this very record (the outputs of one call share a mark and are often dropped
 * together: one wait serves them all). The device must be current. */
static ragvit_status device_own_wait(int32_t device_id, const device_mark *mark,
                                     cudaStream_t *own) {
    *own = NULL;
    RAGVIT_TRY(device_check_id(device_id));
    device_event_state *state = &device_events[device_id];
    pthread_mutex_lock(&device_lock);
    cudaError_t e = cudaSuccess;
    const char *expr = "cudaStreamCreateWithFlags(stream, NonBlocking)";
    if (state->own == NULL) e = cudaStreamCreateWithFlags(&state->own, cudaStreamNonBlocking);
    if (e == cudaSuccess && mark != NULL && mark->serial != state->own_waited) {
        e = cudaStreamWaitEvent(state->own, mark->event, 0);
        expr = "cudaStreamWaitEvent(own, mark, 0)";
        if (e == cudaSuccess) state->own_waited = mark->serial;
    }
    *own = state->own;
    pthread_mutex_unlock(&device_lock);
    if (e != cudaSuccess) return ragvit_cuda_fail((int)e, expr, __FILE__, __LINE__);
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_stream_wait(int32_t device_id, void *consumer,
                                                 void *producer) {
    if (consumer == producer) return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    device_mark *mark = NULL;
    RAGVIT_TRY(device_mark_record(device_id, producer, &mark));
    /* The wait holds the event's state as of now: the mark is released at once. */
    const cudaError_t e = cudaStreamWaitEvent((cudaStream_t)consumer, mark->event, 0);
    device_mark_release(mark);
    if (e != cudaSuccess)
        return ragvit_cuda_fail((int)e, "cudaStreamWaitEvent(consumer, event, 0)", __FILE__,
                                __LINE__);
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

/* The legacy default stream (0 or cudaStreamLegacy): one stream per device for the whole
 * process, which no caller can destroy. */
static bool device_is_legacy(const void *stream) {
    return stream == NULL || stream == (const void *)cudaStreamLegacy;
}

/* A kept block of `bytes` for an allocation on `stream`, or NULL. Kept blocks were last used
 * before a mark on the legacy default stream, so an allocation on that stream is ordered after
 * their last use by the stream itself: no CUDA call (no wait, free or allocation), where the
 * pool's way costs three (cudaStreamWaitEvent and cudaFreeAsync on ragvit's own stream at the
 * free, cudaMallocFromPoolAsync at the allocation). Any other stream takes the pool's way. */
static void *device_block_take(int32_t device_id, size_t bytes, const void *stream) {
    if (!device_is_legacy(stream) || device_id < 0 || device_id >= RAGVIT_MAX_DEVICES) return NULL;
    device_event_state *state = &device_events[device_id];
    void *data = NULL;
    device_mark *mark = NULL;
    pthread_mutex_lock(&device_lock);
    for (int i = state->block_count - 1; i >= 0; i--) {
        if (state->blocks[i].bytes != bytes) continue;
        data = state->blocks[i].data;
        mark = state->blocks[i].mark;
        memmove(&state->blocks[i], &state->blocks[i + 1],
                (size_t)(state->block_count - i - 1) * sizeof state->blocks[0]);
        state->block_count--;
        state->reused++;
        break;
    }
    pthread_mutex_unlock(&device_lock);
    if (mark != NULL) device_mark_release(mark); /* takes device_lock itself */
    return data;
}

/* Keeps a freed block whose mark is on the legacy default stream (the buffer's reference to
 * the mark moves to the block); *evicted: the oldest block, to free, when there was no room
 * ({NULL} otherwise). 0: not kept (another stream, no mark, too large). */
static int device_block_keep(int32_t device_id, void *data, size_t bytes, device_mark *mark,
                             device_block *evicted) {
    evicted->data = NULL;
    evicted->mark = NULL;
    if (mark == NULL || !device_is_legacy(mark->stream) || bytes > DEVICE_BLOCK_MAX_BYTES ||
        device_id < 0 || device_id >= RAGVIT_MAX_DEVICES) {
        return 0;
    }
    device_event_state *state = &device_events[device_id];
    pthread_mutex_lock(&device_lock);
    if (state->block_count == DEVICE_BLOCK_COUNT) {
        *evicted = state->blocks[0];
        memmove(&state->blocks[0], &state->blocks[1],
                (size_t)(DEVICE_BLOCK_COUNT - 1) * sizeof state->blocks[0]);
        state->block_count--;
    }
    state->blocks[state->block_count].data = data;
    state->blocks[state->block_count].bytes = bytes;
    state->blocks[state->block_count].mark = mark;
    state->block_count++;
    pthread_mutex_unlock(&device_lock);
    return 1;
}

extern "C" ragvit_status ragvit_cuda_memory_alloc(ragvit_device_info *dev, size_t bytes,
                                                  void *stream, void **data) {
    *data = device_block_take(dev->device_id, bytes, stream);
    if (*data != NULL) return RAGVIT_STATUS_OK;
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

extern "C" ragvit_status ragvit_cuda_memory_mark(int32_t device_id, void *stream, void **mark) {
    *mark = NULL;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    device_mark *m = NULL;
    RAGVIT_TRY(device_mark_record(device_id, stream, &m));
    *mark = (void *)m;
    return RAGVIT_STATUS_OK;
}

extern "C" void ragvit_cuda_memory_mark_retain(void *mark) {
    __atomic_fetch_add(&((device_mark *)mark)->refs, 1, __ATOMIC_RELAXED);
}

extern "C" void ragvit_cuda_memory_mark_release(void *mark) {
    device_mark_release((device_mark *)mark);
}

extern "C" ragvit_status ragvit_cuda_memory_wait(int32_t device_id, void *stream, void *mark) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)stream, ((device_mark *)mark)->event, 0));
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_memory_stream(int32_t device_id, void *mark, void **stream) {
    *stream = NULL;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    cudaStream_t own = NULL;
    RAGVIT_TRY(device_own_wait(device_id, (device_mark *)mark, &own));
    *stream = (void *)own;
    return RAGVIT_STATUS_OK;
}

/* Without a mark (a buffer dropped before its call marked it) the device's work so far is
 * waited for. At exit the runtime may be unloading: the process frees everything. */
extern "C" ragvit_status ragvit_cuda_memory_free(int32_t device_id, void *data, size_t bytes,
                                                 void *mark) {
    device_block evicted;
    if (device_block_keep(device_id, data, bytes, (device_mark *)mark, &evicted)) {
        if (evicted.data == NULL) return RAGVIT_STATUS_OK;
        data = evicted.data;
        mark = evicted.mark;
    }
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(device_id));
    cudaStream_t own = NULL;
    cudaError_t e = cudaSuccess;
    if (mark != NULL) {
        const ragvit_status status = device_own_wait(device_id, (device_mark *)mark, &own);
        device_mark_release((device_mark *)mark);
        RAGVIT_TRY(status);
    } else {
        RAGVIT_TRY(device_own_wait(device_id, NULL, &own));
        e = cudaDeviceSynchronize();
    }
    if (e == cudaSuccess) e = cudaFreeAsync(data, own);
    if (e == cudaSuccess || e == cudaErrorCudartUnloading) return RAGVIT_STATUS_OK;
    return ragvit_cuda_fail((int)e, "cudaFreeAsync(data, stream)", __FILE__, __LINE__);
}

extern "C" ragvit_status ragvit_cuda_memory_stats(int32_t device_id, int64_t *events,
                                                  int64_t *marks, int64_t *reused) {
    *events = 0;
    *marks = 0;
    *reused = 0;
    RAGVIT_TRY(device_check_id(device_id));
    pthread_mutex_lock(&device_lock);
    *events = device_events[device_id].created;
    *marks = device_events[device_id].recorded;
    *reused = device_events[device_id].reused;
    pthread_mutex_unlock(&device_lock);
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_launch_empty(const ragvit_device_info *dev, void *stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_ATTENTION, device_empty_kernel, dim3(1), dim3(1), 0,
                         (cudaStream_t)stream));
    return RAGVIT_STATUS_OK;
}
