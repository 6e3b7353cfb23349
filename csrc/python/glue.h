/* glue.h — the internal header of ragvit._C: module and call state, import
 * slots, the signature each op wrapper declares, and what each file of the glue
 * offers the others (errors.c raises, args.c parses, interop.c imports and
 * allocates, buffer.c holds ragvit.Buffer, bind_<family>.c wrap the ops,
 * module.c holds the lifecycle).
 * Decision: the helpers every call passes through (raise_status, keyword_index,
 * call_begin, finish_streams, call_end) are static inline here: each .c is its
 * own translation unit, and a call per helper would tax the ~4 us host path. */
#ifndef RAGVIT_GLUE_H
#define RAGVIT_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "dlpack_abi.h"
#include "ragvit.h"

#define API_CACHE_SIZE 8
#define PLAIN_CACHE_SIZE 8
#define NAMESPACE_CACHE_SIZE 8
#define MAX_IMPORTS 8

/* A type seen as an argument. Only types with an exchange API and static types
 * (NumPy's ndarray) are cached here, so the cache never keeps a user's class alive; other
 * heap types go to plain_cache. */
typedef struct {
    PyTypeObject *type;           /* strong reference */
    const DLPackExchangeAPI *api; /* NULL: the type has none */
    int is_torch;                 /* a subclass of torch's TensorBase: neg bit, version counter */
} api_cache_entry;

/* A heap type without an exchange API (a user's class, JAX's or Numba's array), known by
 * identity and method-cache version tag and held by neither: CPython never hands a tag out
 * twice and takes it back when the type or its bases change (PyType_Modified), so an entry
 * whose tag still matches describes this very type as it is now. */
typedef struct {
    PyTypeObject *type;   /* identity only */
    unsigned int version; /* its tp_version_tag when looked up; 0: empty entry */
    int is_torch;
} plain_cache_entry;

/* The array namespace of a type that allocated through ragvit.Buffer. The type is held
 * weakly (a user's class is never kept alive): an entry whose type died is stale, even if
 * a new type reuses the address. */
typedef struct {
    PyTypeObject *type;    /* identity only */
    PyObject *type_ref;    /* weak reference to type */
    PyObject *from_dlpack; /* type().__array_namespace__().from_dlpack; NULL: none */
    int is_cupy;           /* type is CuPy's ndarray (see cupy_state) */
} namespace_cache_entry;

/* CuPy's constructors, resolved (never imported: a cupy.ndarray was an argument) the first
 * time an output goes to a cupy.ndarray argument, so that output is built as a cupy.ndarray
 * in C instead of through cupy.from_dlpack. All NULL until then. */
typedef struct {
    PyTypeObject *ndarray;    /* cupy.ndarray (strong reference) */
    newfunc base_new;         /* tp_new of its extension base, when `init` is set */
    PyObject *init;           /* the base's _init(shape, dtype, memptr); NULL: the constructor */
    PyObject *memory_pointer; /* cupy.cuda.MemoryPointer */
    PyObject *unowned_memory; /* cupy.cuda.UnownedMemory */
    PyObject *current_stream; /* cupy.cuda.get_current_stream, where stream_ptr is NULL */
    intptr_t (*stream_ptr)(int device_id); /* CuPy's C function behind it (its raw handle) */
    PyObject *kw_memptr;                   /* ("memptr",), the constructor's kwnames */
    PyObject *str_ptr;                     /* "ptr" */
    PyObject *empty_tuple;
    PyObject *dtypes[RAGVIT_DTYPE_COUNT]; /* numpy.dtype per ragvit dtype; NULL: none (bfloat16) */
} cupy_state;

typedef struct {
    ragvit_context ctx;
    api_cache_entry api_cache[API_CACHE_SIZE];
    int api_cache_count;
    plain_cache_entry plain_cache[PLAIN_CACHE_SIZE];
    int plain_cache_next; /* the entry the next heap type replaces, round robin */
    namespace_cache_entry namespace_cache[NAMESPACE_CACHE_SIZE];
    int namespace_cache_next;          /* the entry the next miss replaces, round robin */
    PyTypeObject *buffer_type;         /* ragvit.Buffer (a heap type of this module) */
    PyObject *torch_is_neg;            /* TensorBase.is_neg, once a torch tensor was seen */
    PyObject *torch_increment_version; /* torch._C._increment_version, on first use */
    int is_increment_version_iterable; /* it takes a tuple of tensors (else one tensor) */
    PyObject *torch_is_grad_enabled;   /* torch._C.is_grad_enabled, with the one above */
    PyCFunction is_grad_enabled_c;     /* its C function when a plain METH_NOARGS one, else NULL */
    PyObject *str_dlpack;
    PyObject *str_dlpack_device;
    PyObject *str_cai;
    PyObject *str_requires_grad;
    PyObject *str_cuda_stream;
    PyObject *str_exchange_api;
    PyObject *str_stream;
    PyObject *str_max_version;
    PyObject *str_array_namespace;
    PyObject *str_from_dlpack;
    PyObject *max_version; /* (1, 0) */
    cupy_state cupy;
} module_state;

enum import_kind { IMPORT_EXCHANGE = 1, IMPORT_NUMPY, IMPORT_DLPACK, IMPORT_CAI, IMPORT_BUFFER };

/* ragvit.Buffer: an output ragvit allocated itself, exported through DLPack and the CUDA
 * (or NumPy) array interface. Its fields never change after creation, except `mark` and the
 * hand-off pair. */
typedef struct {
    PyObject ob_base;    /* PyObject_HEAD, spelled out so clang-format keeps one field a line */
    void *data;          /* owned: ragvit_memory_alloc */
    size_t nbytes;       /* the array's bytes (at least one byte is allocated) */
    int32_t device_type; /* RAGVIT_DEVICE_* */
    int32_t device_id;
    int32_t dtype;
    int32_t ndim;
    int64_t shape[RAGVIT_MAX_DIMS];
    int64_t strides[RAGVIT_MAX_DIMS]; /* compact, in elements */
    void *mark; /* CUDA: the point after its last known use (ragvit_memory_mark, one reference
                 * held); NULL before its creating call has launched */
    int is_handing_off;   /* 1 while wrap_output hands it to the caller's array type */
    void *handoff_stream; /* meanwhile: the stream of the call that marked it */
    PyObject *weakreflist;
} buffer_object;

/* What one imported argument holds until the call ends. Phase 1 fills kind,
 * obj, api and capsule (every Python-level protocol); phase 2 the view. */
typedef struct {
    int kind;
    int arg;       /* index in the signature (the view is t[arg]) */
    PyObject *obj; /* borrowed: the caller holds its arguments for the whole call */
    const DLPackExchangeAPI *api;
    PyObject *capsule;       /* __dlpack__'s capsule; renamed "used_*" once its view is taken */
    DLManagedTensor *legacy; /* owned through capsule once renamed */
    DLManagedTensorVersioned *versioned;
} import_slot;

/* An op's Python signature, one static per wrapper: names in call order, the
 * first max_positional may be given positionally, the first `required` must be
 * given, and the last is always stream=. Bit ARG_BIT(i) of `arrays` marks
 * names[i] as an array that call_import imports into t[i]. */
typedef struct {
    const char *op;
    const char *const *names;
    int count;
    int max_positional;
    int required;
    unsigned arrays;
    unsigned outputs; /* the arrays the op writes (their torch version counters are bumped) */
} op_signature;

#define ARG_BIT(i) (1u << (i))
#define ARRAY_COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))
/* The initializer of a static op_signature; count comes from the names array. */
#define SIGNATURE(op, names, max_positional, required, arrays, outputs)                            \
    {(op), (names), ARRAY_COUNT(names), (max_positional), (required), (arrays), (outputs)}

typedef struct {
    module_state *st;
    const char *op;
    const op_signature *sig; /* NULL for _launch_empty, which parses its own arguments */
    int is_stream_resolved;
    void *stream;
    import_slot slots[MAX_IMPORTS];
    int slot_count;
    void *cai_streams[MAX_IMPORTS]; /* producer streams to wait on (CAI v3, ragvit.Buffer) */
    int32_t cai_devices[MAX_IMPORTS];
    int cai_stream_count;
    int is_cuda;                    /* some imported array lives on a CUDA device */
    int64_t max_numel;              /* elements of the largest array imported or allocated */
    PyObject *written[MAX_IMPORTS]; /* borrowed: torch outputs given by the caller */
    int written_count;
    int grad_mode;          /* torch's grad mode for this call: -1 not asked yet, 0 off, 1 on */
    PyObject *wrap_arg;     /* borrowed: the first array argument, once a Buffer was allocated */
    int is_handoff_ordered; /* CuPy's current stream waits on this call's mark already */
} call_state;

/* *result: obj.name, or NULL when obj has no such attribute (AttributeError
 * only: any other exception a producer raises, KeyboardInterrupt included,
 * propagates with -1). */
static inline int lookup_optional(PyObject *obj, PyObject *name, PyObject **result) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, result);
#else
    return _PyObject_LookupAttr(obj, name, result);
#endif
}

/* ---- errors.c ---- */

/* The one place a failing ragvit_status becomes a Python exception. Returns -1. */
int raise_failure(ragvit_status status);

/* 0 for RAGVIT_STATUS_OK, else raise_failure (-1). */
static inline int raise_status(ragvit_status status) {
    return status == RAGVIT_STATUS_OK ? 0 : raise_failure(status);
}

#define RAISE_IF(status_expr)                                                                      \
    do {                                                                                           \
        ragvit_status rs_ = (status_expr);                                                         \
        if (rs_ != RAGVIT_STATUS_OK) {                                                             \
            raise_status(rs_);                                                                     \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

/* ---- args.c: FASTCALL parsing; each returns 0, or -1 with an exception ---- */

/* Index of keyword key (a str) among names[0..count), or -1. Call sites pass
 * compact ASCII keywords: those compare here without a call, the key read once
 * and most names refused at their first letter; anything else takes CPython's path. */
static inline int keyword_index(PyObject *key, const char *const *names, int count) {
    if (!PyUnicode_IS_COMPACT_ASCII(key)) {
        for (int i = 0; i < count; i++) {
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) return i;
        }
        return -1;
    }
    const char *data = (const char *)PyUnicode_DATA(key);
    const size_t length = (size_t)PyUnicode_GET_LENGTH(key);
    if (length == 0) return -1;
    for (int i = 0; i < count; i++) {
        if (names[i][0] == data[0] && strlen(names[i]) == length &&
            memcmp(data, names[i], length) == 0) {
            return i;
        }
    }
    return -1;
}

/* Fills values[i] (borrowed) for each of sig's names: NULL when absent or None. */
int parse_args(const op_signature *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               PyObject **values);
/* stream= (obj NULL: absent) into cs->stream. */
int parse_stream(call_state *cs, PyObject *obj);
/* The scalar argument values[i], named sig->names[i] in messages; absent: the default.
 * Ints are any object with __index__ (NumPy integers included), parsed before any
 * array is imported, so their Python code runs before a raw view is taken. */
int parse_max_seqlen(call_state *cs, PyObject *const *values, int i, int64_t *max_seqlen);
int parse_float(call_state *cs, PyObject *const *values, int i, double fallback, double *value);
int parse_count(call_state *cs, PyObject *const *values, int i, long long *value);

/* ---- interop.c: imports and allocation ---- */

/* Imports NumPy's C API table, which NumPy keeps per translation unit (interop.c's). */
int import_numpy_api(void);
/* Resolves stream= (the signature's last argument), then imports every array
 * argument: values[i] into t[i] (absent: t[i].is_present = 0). Two phases: every
 * Python-level protocol of every argument first (__dlpack__, __dlpack_device__,
 * __cuda_array_interface__, torch's is_neg), then the raw views, so no Python code
 * runs between taking a view and the end of the call. */
int call_import(call_state *cs, PyObject *const *values, ragvit_tensor *t);
/* Runs the deleters of consumed capsules; safe to call more than once. */
void release_slots(call_state *cs);
/* Bumps the autograd version counter of the torch outputs the call wrote. */
int bump_versions(call_state *cs);
/* New array of `shape` on like's device for the first imported argument (slot 0):
 * through its type's exchange-API allocator, as a NumPy array for a NumPy argument, else
 * a ragvit.Buffer that wrap_output turns into the argument's own type once the op ran.
 * Its view goes to *view. NULL with an exception. */
PyObject *alloc_like(call_state *cs, const ragvit_tensor *like, const char *name, int32_t dtype,
                     int ndim, const int64_t *shape, ragvit_tensor *view);
/* obj (stolen) as the caller gets it: a CUDA Buffer alloc_like made for a cupy.ndarray
 * argument becomes a cupy.ndarray over it, built in C (CuPy's current stream made to wait on
 * the call's mark when it is not the call's stream); another Buffer goes through
 * `type(arg).__array_namespace__().from_dlpack` (cached per type) when that exists;
 * anything else is returned as it is. NULL with an exception. */
PyObject *wrap_output(call_state *cs, PyObject *obj);
/* The cupy.ndarray that wrap_output would return for buffer when like is the first array
 * argument (the tests' view of that route; no stream is touched): a new reference, Py_None
 * (new reference) when the route does not apply, or NULL with an exception. */
PyObject *cupy_ndarray_like(module_state *st, PyObject *like, PyObject *buffer);
/* CuPy's current stream on device (its raw handle, as an int), or None before CuPy's
 * constructors were resolved (the tests' view). NULL with an exception. */
PyObject *cupy_current_stream_of(module_state *st, int32_t device_id);
/* Releases the references st->cupy holds (module clear). */
void cupy_state_clear(cupy_state *cupy);
/* Visits them (module traverse). */
int cupy_state_traverse(const cupy_state *cupy, visitproc visit, void *arg);
/* Marks the point after this call's launches on every CUDA Buffer it read or returned
 * (outputs[0..count), NULL entries and non-Buffers skipped), so their frees wait for it: one
 * mark (one event record) per call, shared by them all; -1 with an exception set. */
int mark_buffers(call_state *cs, PyObject *const *outputs, int count);

/* ---- buffer.c ---- */

/* A new Buffer of `shape` (compact) on a device, its memory allocated on cs->stream. */
PyObject *buffer_new(call_state *cs, int32_t device_type, int32_t device_id, int32_t dtype,
                     int ndim, const int64_t *shape);
/* The slots of ragvit.Buffer (module.c's type spec). */
void buffer_dealloc(PyObject *obj);
PyObject *buffer_repr(PyObject *obj);
PyObject *buffer_dlpack(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *buffer_dlpack_device(PyObject *obj, PyObject *unused);
PyObject *buffer_get_shape(PyObject *obj, void *unused);
PyObject *buffer_get_ndim(PyObject *obj, void *unused);
PyObject *buffer_get_dtype(PyObject *obj, void *unused);
PyObject *buffer_get_cai(PyObject *obj, void *unused);
PyObject *buffer_get_array_interface(PyObject *obj, void *unused);

/* ---- the call of every op wrapper ---- */

/* Only the counters and flags: slots and CAI entries are written before use. */
static inline void call_init(call_state *cs, PyObject *module, const char *op) {
    cs->st = (module_state *)PyModule_GetState(module);
    cs->op = op;
    cs->sig = NULL;
    cs->is_stream_resolved = 0;
    cs->stream = NULL;
    cs->slot_count = 0;
    cs->cai_stream_count = 0;
    cs->is_cuda = 0;
    cs->max_numel = 0;
    cs->written_count = 0;
    cs->grad_mode = -1;
    cs->wrap_arg = NULL;
    cs->is_handoff_ordered = 0;
}

/* Starts an op wrapper's call: the state, then sig's arguments into values. */
static inline int call_begin(call_state *cs, PyObject *module, const op_signature *sig,
                             PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                             PyObject **values) {
    call_init(cs, module, sig->op);
    cs->sig = sig;
    return parse_args(sig, args, nargs, kwnames, values);
}

/* After all imports: the call runs on cs->stream; wait for CAI producers. */
static inline int finish_streams(call_state *cs) {
    for (int i = 0; i < cs->cai_stream_count; i++) {
        if (raise_status(ragvit_stream_wait(cs->cai_devices[i], cs->stream, cs->cai_streams[i]))) {
            return -1;
        }
    }
    return 0;
}

/* Host calls smaller than this keep the GIL: handing it over and back costs
 * about as much as the op's whole glue (callgrind: ~2500 instructions). */
#define GIL_RELEASE_MIN_ELEMENTS ((int64_t)1 << 15)

/* Runs call (a core op returning a ragvit_status) and sets rc as raise_status
 * does, without the GIL when every array is on the host and the call is large
 * enough: the arguments are pinned by the call and the views are plain memory
 * (the exception is raised once the GIL is back). A CUDA call only enqueues work
 * (a few us) and keeps it. */
#define CORE_CALL(cs, rc, call)                                                                    \
    do {                                                                                           \
        ragvit_status status_;                                                                     \
        if ((cs)->is_cuda || (cs)->max_numel < GIL_RELEASE_MIN_ELEMENTS) {                         \
            status_ = (call);                                                                      \
        } else {                                                                                   \
            PyThreadState *saved_ = PyEval_SaveThread();                                           \
            status_ = (call);                                                                      \
            PyEval_RestoreThread(saved_);                                                          \
        }                                                                                          \
        (rc) = raise_status(status_);                                                              \
    } while (0)

/* The one exit of an op wrapper: releases the imports, bumps the version of
 * the torch outputs written, then returns result (stolen) when rc is 0, else
 * drops it and returns NULL (the exception is set). */
static inline PyObject *call_end(call_state *cs, PyObject *result, int rc) {
    if (mark_buffers(cs, &result, 1) < 0 && rc == 0) rc = -1;
    release_slots(cs);
    if (rc == 0 && cs->written_count > 0) rc = bump_versions(cs);
    if (rc == 0 && cs->wrap_arg != NULL) return wrap_output(cs, result);
    if (rc == 0) return result;
    Py_XDECREF(result);
    return NULL;
}

/* ---- bind_<family>.c: the module's functions (module.c's method table) ---- */

#define FASTCALL_ARGS PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames
PyObject *py_attention(FASTCALL_ARGS);
PyObject *py_pack(FASTCALL_ARGS);
PyObject *py_pack_into(FASTCALL_ARGS);
PyObject *py_unpack(FASTCALL_ARGS);
PyObject *py_gather_prefix(FASTCALL_ARGS);
PyObject *py_segment_mean(FASTCALL_ARGS);
PyObject *py_repack(FASTCALL_ARGS);
PyObject *py_repack_into(FASTCALL_ARGS);
PyObject *py_linear(FASTCALL_ARGS);
PyObject *py_layer_norm(FASTCALL_ARGS);
PyObject *py_gelu(FASTCALL_ARGS);
PyObject *py_topk_index(FASTCALL_ARGS);
PyObject *py_graph_replay(FASTCALL_ARGS);
PyObject *py_launch_empty(FASTCALL_ARGS);
PyObject *py_memory_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_cupy_ndarray(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_cupy_current_stream(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_build_info(PyObject *module, PyObject *unused);
PyObject *py_cuda_is_compiled(PyObject *module, PyObject *unused);
PyObject *py_cuda_device_count(PyObject *module, PyObject *unused);
PyObject *py_set_debug(PyObject *module, PyObject *flag);
PyObject *py_is_debug(PyObject *module, PyObject *unused);

#endif /* RAGVIT_GLUE_H */
