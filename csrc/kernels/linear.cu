/* linear.cu — out (M, N) = x (M, K) . weight (N, K)^T + bias + residual through cuBLASLt (no
 * kernel of its own): column-major D (N, M) = op(A = weight, T) . B (= x), the BIAS epilogue, and
 * the residual epilogue: beta = 1 on C = residual (C == D, in place, is allowed). cuBLASLt is
 * dlopen()ed on first use, so the module imports and runs every other op without it: its soname
 * (already loaded by torch or CuPy, or found through LD_LIBRARY_PATH, the module's RUNPATH of
 * NVIDIA wheel folders, the system's), then the library an in-place build found. Decision:
 * per device one handle, per-stream workspaces and a plan cache (descriptors + the heuristic's
 * first algorithm): a seen shape costs no descriptor or query; the heuristic's choice is taken as
 * is (timing its candidates: +1.7% on an H200 DeiT-S batch-1 graph, a host sync per new shape).
 * Covered by tests/test_linear.py (vs float64, residual epilogue, in place, capture, errors). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cuda_util.cuh"

#ifdef RAGVIT_HAVE_CUBLASLT
#include <cublasLt.h>

#define LINEAR_STR2(x) #x
#define LINEAR_STR(x) LINEAR_STR2(x)

static constexpr int kLinearStreams = 8;
static constexpr int kLinearCacheSlots = 128;
static constexpr size_t kLinearWorkspaceBytes = (size_t)32 << 20;
static constexpr int kLinearProbe = 8; /* cache slots a key may occupy: h, h + 1, ... */

// ---- the cuBLASLt entry points (dlopen) ----

struct linear_api {
    int is_loaded;
    void *lib;
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtGetStatusString) status_string;
    decltype(&cublasLtMatmulDescCreate) desc_create;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set;
    decltype(&cublasLtMatrixLayoutCreate) layout_create;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create;
    decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    decltype(&cublasLtMatmul) matmul;
};

/* Everything the heuristic's choice depends on. */
struct linear_key {
    int64_t rows, cols, inner;
    int64_t x_stride, weight_stride, out_stride, residual_stride;
    int32_t dtype, has_bias, has_residual;
    uint32_t align[5]; /* x, weight, residual, out, bias: bytes, <= 256 */
    uint64_t workspace;
};

struct linear_plan {
    int is_used;
    linear_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c, d;
    cublasLtMatmulAlgo_t algo;
};

/* A 32 MiB workspace for each of the first kLinearStreams streams (one shared workspace would race
 * between streams; later streams, and a stream first seen while capturing, run workspace-free
 * algorithms); plans: open addressing, a key in slots h .. h + kLinearProbe - 1, so the handful
 * of shapes in a forward do not evict each other. */
struct linear_device {
    int is_initialized;
    cublasLtHandle_t handle;
    cudaStream_t streams[kLinearStreams];
    void *workspaces[kLinearStreams];
    int num_streams;
    unsigned int evictions; /* round-robin victim within a full probe window */
    linear_plan plans[kLinearCacheSlots];
};

/* Process-lifetime state, like the device error flag: freeing it at exit would race the CUDA
 * runtime's teardown. */
static pthread_mutex_t linear_lock = PTHREAD_MUTEX_INITIALIZER;
static linear_api linear_lib;
static linear_device linear_devices[RAGVIT_MAX_DEVICES];

// ---- host helpers ----

static ragvit_status linear_load_api(linear_api *api) {
    if (api->is_loaded) return RAGVIT_STATUS_OK;
    const char *names[] = {"libcublasLt.so." LINEAR_STR(CUBLAS_VER_MAJOR),
#ifdef RAGVIT_CUBLASLT_PATH
                           RAGVIT_CUBLASLT_PATH,
#endif
                           "libcublasLt.so"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && lib == NULL; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return ragvit_fail(RAGVIT_STATUS_CUDA_ERROR,
                           "linear: cuBLASLt must be loadable (libcublasLt.so.%d: the "
                           "nvidia-cublas wheel beside ragvit, a library torch or CuPy loaded, "
                           "LD_LIBRARY_PATH or the system's), got: %s",
                           (int)CUBLAS_VER_MAJOR, dlerror());
    linear_api a;
    memset(&a, 0, sizeof a);
    a.lib = lib;
    void **slots[] = {
        (void **)&a.create,         (void **)&a.status_string, (void **)&a.desc_create,
        (void **)&a.desc_destroy,   (void **)&a.desc_set,      (void **)&a.layout_create,
        (void **)&a.layout_destroy, (void **)&a.pref_create,   (void **)&a.pref_destroy,
        (void **)&a.pref_set,       (void **)&a.heuristic,     (void **)&a.matmul};
    const char *symbols[] = {"cublasLtCreate",
                             "cublasLtGetStatusString",
                             "cublasLtMatmulDescCreate",
                             "cublasLtMatmulDescDestroy",
                             "cublasLtMatmulDescSetAttribute",
                             "cublasLtMatrixLayoutCreate",
                             "cublasLtMatrixLayoutDestroy",
                             "cublasLtMatmulPreferenceCreate",
                             "cublasLtMatmulPreferenceDestroy",
                             "cublasLtMatmulPreferenceSetAttribute",
                             "cublasLtMatmulAlgoGetHeuristic",
                             "cublasLtMatmul"};
    static_assert(sizeof slots / sizeof slots[0] == sizeof symbols / sizeof symbols[0],
                  "one symbol name per entry point");
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *slots[i] = dlsym(lib, symbols[i]);
        if (*slots[i] == NULL) {
            dlclose(lib);
            return ragvit_fail(RAGVIT_STATUS_CUDA_ERROR,
                               "linear: cuBLASLt must export %s, got a library without it",
                               symbols[i]);
        }
    }
    a.is_loaded = 1;
    *api = a;
    return RAGVIT_STATUS_OK;
}

static ragvit_status linear_blas_fail(const linear_api *api, cublasStatus_t st, const char *expr) {
    return ragvit_fail(st == CUBLAS_STATUS_ALLOC_FAILED ? RAGVIT_STATUS_OUT_OF_MEMORY
                                                        : RAGVIT_STATUS_CUDA_ERROR,
                       "linear: %s failed: %s (%d)", expr, api->status_string(st), (int)st);
}

#define BLAS_TRY(api, x)                                                                           \
    do {                                                                                           \
        cublasStatus_t st_ = (x);                                                                  \
        if (st_ != CUBLAS_STATUS_SUCCESS) return linear_blas_fail((api), st_, #x);                 \
    } while (0)

static uint32_t linear_alignment(const void *p) {
    const uintptr_t v = (uintptr_t)p;
    uint32_t align = 1;
    while (align < 256 && (v & (uintptr_t)(2 * align - 1)) == 0) align *= 2;
    return p == NULL ? 256 : align;
}

/* Frees a plan's descriptors (a cache slot being reused). */
static void linear_plan_release(const linear_api *api, linear_plan *p) {
    if (!p->is_used) return;
    api->layout_destroy(p->a);
    api->layout_destroy(p->b);
    api->layout_destroy(p->c);
    api->layout_destroy(p->d);
    api->desc_destroy(p->desc);
    memset(p, 0, sizeof *p);
}

/* The heuristic's best algorithm for plan p's descriptors (*found = 0: none) under key k's
 * workspace and pointer alignments. */
static ragvit_status linear_heuristic(const linear_api *api, cublasLtHandle_t handle,
                                      const linear_key *k, const linear_plan *p,
                                      cublasLtMatmulHeuristicResult_t *result, int *found) {
    cublasLtMatmulPreference_t pref = NULL;
    BLAS_TRY(api, api->pref_create(&pref));
    const uint64_t ws = k->workspace;
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasStatus_t st =
        api->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
        st = api->pref_set(pref, aligns[i], &k->align[i], sizeof k->align[i]);
    *found = 0;
    memset(result, 0, sizeof *result);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = api->heuristic(handle, p->desc, p->a, p->b, p->c, p->d, pref, 1, result, found);
    api->pref_destroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS)
        return linear_blas_fail(api, st, "cublasLtMatmulAlgoGetHeuristic");
    return RAGVIT_STATUS_OK;
}

/* Descriptors and the heuristic's best algorithm for key into p. */
static ragvit_status linear_plan_build(const linear_api *api, cublasLtHandle_t handle,
                                       const linear_key *k, const void *bias, linear_plan *p) {
    const cudaDataType_t type = k->dtype == RAGVIT_DTYPE_F16    ? CUDA_R_16F
                                : k->dtype == RAGVIT_DTYPE_BF16 ? CUDA_R_16BF
                                                                : CUDA_R_32F;
    memset(p, 0, sizeof *p);
    BLAS_TRY(api, api->desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    p->is_used = 1; /* from here on linear_plan_release frees what was made */
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    const cublasLtEpilogue_t epilogue =
        k->has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    BLAS_TRY(api, api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a));
    BLAS_TRY(api, api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b));
    BLAS_TRY(api,
             api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    if (k->has_bias)
        BLAS_TRY(api,
                 api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    /* column-major: A = weight (K, N), B = x (K, M), C = residual / D = out (N, M) */
    BLAS_TRY(api, api->layout_create(&p->a, type, (uint64_t)k->inner, (uint64_t)k->cols,
                                     k->weight_stride));
    BLAS_TRY(api,
             api->layout_create(&p->b, type, (uint64_t)k->inner, (uint64_t)k->rows, k->x_stride));
    BLAS_TRY(api, api->layout_create(&p->c, type, (uint64_t)k->cols, (uint64_t)k->rows,
                                     k->has_residual ? k->residual_stride : k->out_stride));
    BLAS_TRY(api,
             api->layout_create(&p->d, type, (uint64_t)k->cols, (uint64_t)k->rows, k->out_stride));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    RAGVIT_TRY(linear_heuristic(api, handle, k, p, &result, &found));
    if (found < 1)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "linear: x, weight and out must be a problem cuBLASLt supports, got "
                           "no algorithm for M=%lld N=%lld K=%lld (row strides %lld/%lld/%lld, "
                           "alignments %u/%u/%u bytes)",
                           (long long)k->rows, (long long)k->cols, (long long)k->inner,
                           (long long)k->x_stride, (long long)k->weight_stride,
                           (long long)k->out_stride, k->align[0], k->align[1], k->align[3]);
    p->algo = result.algo;
    p->key = *k;
    return RAGVIT_STATUS_OK;
}

static uint64_t linear_key_hash(const linear_key *k) {
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Handle, and the workspace of stream (0 bytes past kLinearStreams streams, and for a
 * stream first seen while it is capturing a graph). */
static ragvit_status linear_device_state(linear_device *d, cudaStream_t stream, void **workspace,
                                         uint64_t *workspace_bytes) {
    if (!d->is_initialized) {
        BLAS_TRY(&linear_lib, linear_lib.create(&d->handle));
        d->is_initialized = 1;
    }
    for (int i = 0; i < d->num_streams; i++) {
        if (d->streams[i] == stream) {
            *workspace = d->workspaces[i];
            *workspace_bytes = kLinearWorkspaceBytes;
            return RAGVIT_STATUS_OK;
        }
    }
    *workspace = NULL;
    *workspace_bytes = 0;
    if (d->num_streams == kLinearStreams) return RAGVIT_STATUS_OK;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone)
        return RAGVIT_STATUS_OK; /* no cudaMalloc under capture: workspace-free this time */
    void *ws = NULL;
    CUDA_TRY(cudaMalloc(&ws, kLinearWorkspaceBytes));
    d->streams[d->num_streams] = stream;
    d->workspaces[d->num_streams] = ws;
    d->num_streams++;
    *workspace = ws;
    *workspace_bytes = kLinearWorkspaceBytes;
    return RAGVIT_STATUS_OK;
}

static ragvit_status linear_run(const ragvit_linear_args *a, const ragvit_device_info *dev,
                                cudaStream_t stream) {
    RAGVIT_TRY(linear_load_api(&linear_lib));
    linear_device *d = &linear_devices[dev->device_id];
    void *workspace = NULL;
    uint64_t workspace_bytes = 0;
    RAGVIT_TRY(linear_device_state(d, stream, &workspace, &workspace_bytes));
    linear_key k;
    memset(&k, 0, sizeof k); /* padding bytes take part in hash and compare */
    k.rows = a->rows;
    k.cols = a->cols;
    k.inner = a->inner;
    k.x_stride = a->x_stride;
    k.weight_stride = a->weight_stride;
    k.out_stride = a->out_stride;
    k.residual_stride = a->residual != NULL ? a->residual_stride : 0;
    k.dtype = a->dtype;
    k.has_bias = a->bias != NULL;
    k.has_residual = a->residual != NULL;
    k.align[0] = linear_alignment(a->x);
    k.align[1] = linear_alignment(a->weight);
    k.align[2] = linear_alignment(a->residual != NULL ? a->residual : a->out);
    k.align[3] = linear_alignment(a->out);
    k.align[4] = linear_alignment(a->bias);
    k.workspace = workspace_bytes;
    const uint64_t home = linear_key_hash(&k) % kLinearCacheSlots;
    linear_plan *p = NULL, *free_slot = NULL;
    for (int i = 0; i < kLinearProbe && p == NULL; i++) {
        linear_plan *slot = &d->plans[(home + i) % kLinearCacheSlots];
        if (slot->is_used && memcmp(&slot->key, &k, sizeof k) == 0)
            p = slot;
        else if (!slot->is_used && free_slot == NULL)
            free_slot = slot;
    }
    if (p != NULL && a->bias != NULL) {
        BLAS_TRY(&linear_lib, linear_lib.desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &a->bias, sizeof a->bias));
    } else if (p == NULL) {
        /* a free slot of the probe window, else evict one in turn */
        const uint64_t victim = home + d->evictions++ % kLinearProbe;
        p = free_slot != NULL ? free_slot : &d->plans[victim % kLinearCacheSlots];
        linear_plan_release(&linear_lib, p);
        const ragvit_status s = linear_plan_build(&linear_lib, d->handle, &k, a->bias, p);
        if (s != RAGVIT_STATUS_OK) {
            linear_plan_release(&linear_lib, p);
            return s;
        }
    }
    const float alpha = 1.0f, beta = a->residual != NULL ? 1.0f : 0.0f;
    const void *c = a->residual != NULL ? a->residual : a->out;
    BLAS_TRY(&linear_lib,
             linear_lib.matmul(d->handle, p->desc, &alpha, a->weight, p->a, a->x, p->b, &beta, c,
                               p->c, a->out, p->d, &p->algo, workspace, workspace_bytes, stream));
    return RAGVIT_STATUS_OK;
}

// ---- launcher ----

extern "C" ragvit_status ragvit_cuda_linear(const ragvit_linear_args *a,
                                            const ragvit_device_info *dev, void *stream) {
    if (a->rows <= 0 || a->cols <= 0) return RAGVIT_STATUS_OK;
    if (a->dtype != RAGVIT_DTYPE_F16 && a->dtype != RAGVIT_DTYPE_BF16 &&
        a->dtype != RAGVIT_DTYPE_F32)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "linear: x must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    if (dev->device_id < 0 || dev->device_id >= RAGVIT_MAX_DEVICES)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DEVICE, "linear: device must be < %d, got %d",
                           RAGVIT_MAX_DEVICES, (int)dev->device_id);
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    pthread_mutex_lock(&linear_lock);
    const ragvit_status s = linear_run(a, dev, (cudaStream_t)stream);
    pthread_mutex_unlock(&linear_lock);
    return s;
}

#else /* built without the cuBLASLt header */

extern "C" ragvit_status ragvit_cuda_linear(const ragvit_linear_args *a,
                                            const ragvit_device_info *dev, void *stream) {
    (void)a;
    (void)dev;
    (void)stream;
    return ragvit_fail(RAGVIT_STATUS_NO_CUDA,
                       "linear: x must be a CPU array in a build without cuBLASLt (cublasLt.h "
                       "was not found when this module was built), got a CUDA array");
}

#endif
