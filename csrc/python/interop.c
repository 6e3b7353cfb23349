/* interop.c — every way an argument becomes a ragvit_tensor view, and every
 * output ragvit allocates. Protocol per argument: (1) the type's DLPack C
 * exchange API (`__dlpack_c_exchange_api__`, cached per type; fills a stack
 * DLTensor with no allocation), (2) NumPy arrays, (3) `__dlpack__` (versioned
 * capsules, then legacy), (4) `__cuda_array_interface__` v2/v3; ragvit's own
 * Buffer is read directly. Outputs come from the first argument's library
 * (exchange-API allocator), NumPy for NumPy arguments, else a ragvit.Buffer handed
 * back as a cupy.ndarray built here (CuPy arguments) or through the argument type's
 * `__array_namespace__().from_dlpack` (cached).
 * Decision: two phases. Phase 1 runs every Python-level protocol of every argument
 * (it may run arbitrary producer code, which may free or resize another argument);
 * phase 2 then takes the raw views with C calls only. torch tensors cost one
 * C call each in phase 2; debug mode adds an is_neg call each in phase 1 (torch's
 * method costs about as much as the rest of the call's glue, so it is not paid by
 * default). */
#include "glue.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

int import_numpy_api(void) { return PyArray_ImportNumPyAPI(); }

/* ---- DLPack views ---- */

#define DL_TYPE(code, bits) ((unsigned)(code) << 8 | (unsigned)(bits))

static int dtype_from_dl(DLDataType dt, int32_t *dtype) {
    switch (DL_TYPE(dt.code, dt.bits)) {
    case DL_TYPE(kDLFloat, 16): *dtype = RAGVIT_DTYPE_F16; return 1;
    case DL_TYPE(kDLBfloat, 16): *dtype = RAGVIT_DTYPE_BF16; return 1;
    case DL_TYPE(kDLFloat, 32): *dtype = RAGVIT_DTYPE_F32; return 1;
    case DL_TYPE(kDLFloat, 64): *dtype = RAGVIT_DTYPE_F64; return 1;
    case DL_TYPE(kDLInt, 32): *dtype = RAGVIT_DTYPE_I32; return 1;
    case DL_TYPE(kDLInt, 64): *dtype = RAGVIT_DTYPE_I64; return 1;
    case DL_TYPE(kDLUInt, 8): *dtype = RAGVIT_DTYPE_U8; return 1;
    case DL_TYPE(kDLBool, 8): *dtype = RAGVIT_DTYPE_BOOL; return 1;
    default: return 0;
    }
}

#undef DL_TYPE

static DLDataType dtype_to_dl(int32_t dtype) {
    static const DLDataType table[RAGVIT_DTYPE_COUNT] = {
        [RAGVIT_DTYPE_F16] = {kDLFloat, 16, 1}, [RAGVIT_DTYPE_BF16] = {kDLBfloat, 16, 1},
        [RAGVIT_DTYPE_F32] = {kDLFloat, 32, 1}, [RAGVIT_DTYPE_I32] = {kDLInt, 32, 1},
        [RAGVIT_DTYPE_I64] = {kDLInt, 64, 1},   [RAGVIT_DTYPE_U8] = {kDLUInt, 8, 1},
        [RAGVIT_DTYPE_BOOL] = {kDLBool, 8, 1},  [RAGVIT_DTYPE_F64] = {kDLFloat, 64, 1},
    };
    return table[dtype];
}

/* Strides of a compact row-major t (empty arrays: no element is addressed, so
 * whatever strides the producer reports, e.g. NumPy 2's zeros, are replaced). */
static void compact_strides(ragvit_tensor *t) {
    int64_t compact = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        t->strides[i] = compact;
        compact *= t->shape[i] > 0 ? t->shape[i] : 1;
    }
}

/* The checks every importer shares once the view is filled: a tensor with
 * elements has data (freed storage, a fake tensor, a bad capsule); an empty one
 * gets compact strides. */
static int finish_view(call_state *cs, const char *name, ragvit_tensor *t) {
    /* A producer's shape is data: a negative extent, or extents whose product (of the nonzero
     * ones: an empty array's strides and byte spans are computed from them too) passes int64,
     * would make every size computed from it wrong. */
    int64_t extent = 1;
    int is_empty = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0 ||
            (t->shape[i] > 0 && __builtin_mul_overflow(extent, t->shape[i], &extent))) {
            return raise_failure(ragvit_fail(
                RAGVIT_STATUS_NOT_IMPORTABLE,
                "%s: %s must have non-negative dimensions whose nonzero product fits in 64 bits, "
                "got dimension %d = %lld",
                cs->op, name, i, (long long)t->shape[i]));
        }
        is_empty |= t->shape[i] == 0;
    }
    const int64_t numel = is_empty ? 0 : extent;
    if (numel == 0) {
        compact_strides(t);
    } else if (t->data == NULL) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                         "%s: %s must have data, got a NULL data pointer with %lld "
                                         "elements (freed storage or a tensor without memory)",
                                         cs->op, name, (long long)numel));
    }
    cs->is_cuda |= t->device_type == RAGVIT_DEVICE_CUDA;
    if (numel > cs->max_numel) cs->max_numel = numel;
    return 0;
}

static ragvit_status view_from_dl(ragvit_tensor *t, const DLTensor *dl, int is_read_only,
                                  const char *op, const char *name) {
    if (dl->dtype.lanes != 1) {
        return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                           "%s: %s must have one lane per element, got %u lanes", op, name,
                           (unsigned)dl->dtype.lanes);
    }
    if (!dtype_from_dl(dl->dtype, &t->dtype)) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "%s: %s must be float16, bfloat16, float32, int32, uint8 or bool, got "
                           "DLPack type code %u with %u bits",
                           op, name, (unsigned)dl->dtype.code, (unsigned)dl->dtype.bits);
    }
    if (dl->ndim < 0 || dl->ndim > RAGVIT_MAX_DIMS) {
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must have at most %d dimensions, got %d", op, name,
                           RAGVIT_MAX_DIMS, (int)dl->ndim);
    }
    if (dl->ndim > 0 && dl->shape == NULL) {
        return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                           "%s: %s must have a DLPack shape, got NULL with %d dimensions", op, name,
                           (int)dl->ndim);
    }
    switch (dl->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
        t->device_type = RAGVIT_DEVICE_CPU;
        t->device_id = 0;
        break;
    case kDLCUDA:
    case kDLCUDAManaged:
        t->device_type = RAGVIT_DEVICE_CUDA;
        t->device_id = dl->device.device_id;
        break;
    default:
        return ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                           "%s: %s must live on a CPU or CUDA device, got DLPack device type %d",
                           op, name, (int)dl->device.device_type);
    }
    t->ndim = dl->ndim;
    if (dl->strides != NULL) {
        for (int i = 0; i < dl->ndim; i++) {
            t->shape[i] = dl->shape[i];
            t->strides[i] = dl->strides[i];
        }
    } else {
        for (int i = 0; i < dl->ndim; i++) t->shape[i] = dl->shape[i];
        compact_strides(t);
    }
    t->data = dl->data == NULL ? NULL : (char *)dl->data + dl->byte_offset;
    t->is_read_only = is_read_only;
    t->is_present = 1;
    return RAGVIT_STATUS_OK;
}

/* A producer's C callback failed: its exception, or BufferError if it set none. */
static int raise_callback_failure(call_state *cs, const char *name, const char *what) {
    if (PyErr_Occurred()) return -1;
    return raise_failure(ragvit_fail(
        RAGVIT_STATUS_NOT_IMPORTABLE,
        "%s: %s must be importable, got a failing %s that set no error", cs->op, name, what));
}

/* ---- per-type facts: exchange API, torch ---- */

/* A subclass of torch's tensor base, found by name so torch is never imported
 * here; its is_neg method descriptor is kept the first time one is seen. */
static int resolve_torch(module_state *st, PyTypeObject *type) {
    PyObject *mro = type->tp_mro; /* borrowed */
    if (mro == NULL || !PyTuple_Check(mro)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i); /* borrowed */
        if (strcmp(base->tp_name, "torch._C.TensorBase") != 0 &&
            strcmp(base->tp_name, "torch._C._TensorBase") != 0) {
            continue;
        }
        if (st->torch_is_neg == NULL && base->tp_dict != NULL) {
            PyObject *is_neg = PyDict_GetItemString(base->tp_dict, "is_neg"); /* borrowed */
            if (is_neg != NULL && Py_IS_TYPE(is_neg, &PyMethodDescr_Type)) {
                st->torch_is_neg = Py_NewRef(is_neg);
            }
        }
        return 1;
    }
    return 0;
}

static int lookup_exchange_api(module_state *st, PyTypeObject *type,
                               const DLPackExchangeAPI **api) {
    PyObject *attr = NULL;
    *api = NULL;
    if (lookup_optional((PyObject *)type, st->str_exchange_api, &attr) < 0) return -1;
    if (attr == NULL) return 0;
    const DLPackExchangeAPI *table = NULL;
    if (PyCapsule_IsValid(attr, "dlpack_exchange_api")) {
        table = (const DLPackExchangeAPI *)PyCapsule_GetPointer(attr, "dlpack_exchange_api");
    }
    /* The table must outlive the process (spec), so the capsule may go. */
    Py_DECREF(attr);
    if (table && table->header.version.major == RAGVIT_DLPACK_MAJOR &&
        table->current_work_stream != NULL &&
        table->managed_tensor_from_py_object_no_sync != NULL) {
        *api = table;
    }
    return 0;
}

/* type's method-cache version tag; 0 when it has none (never assigned, or invalidated). */
static unsigned int type_version(const PyTypeObject *type) {
    return (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
}

/* The facts about type, from the caches or looked up into *scratch; NULL with an
 * exception when the lookup raised. */
static const api_cache_entry *type_entry(module_state *st, PyTypeObject *type,
                                         api_cache_entry *scratch) {
    for (int i = 0; i < st->api_cache_count; i++) {
        if (st->api_cache[i].type == type) return &st->api_cache[i];
    }
    scratch->type = type;
    scratch->api = NULL;
    const unsigned int version = type_version(type);
    for (int i = 0; version != 0 && i < PLAIN_CACHE_SIZE; i++) {
        const plain_cache_entry *plain = &st->plain_cache[i];
        if (plain->type == type && plain->version == version) {
            scratch->is_torch = plain->is_torch;
            return scratch;
        }
    }
    if (lookup_exchange_api(st, type, &scratch->api) < 0) return NULL;
    scratch->is_torch = resolve_torch(st, type);
    if (scratch->api != NULL || !(type->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        if (st->api_cache_count < API_CACHE_SIZE) {
            api_cache_entry *entry = &st->api_cache[st->api_cache_count++];
            *entry = *scratch;
            Py_INCREF(type);
            return entry;
        }
        return scratch;
    }
    /* The lookup above gave type a version tag, unless CPython ran out of them. */
    const unsigned int looked_up = type_version(type);
    if (looked_up != 0) {
        plain_cache_entry *plain = &st->plain_cache[st->plain_cache_next];
        st->plain_cache_next = (st->plain_cache_next + 1) % PLAIN_CACHE_SIZE;
        plain->type = type;
        plain->version = looked_up;
        plain->is_torch = scratch->is_torch;
    }
    return scratch;
}

/* ---- streams ---- */

static int resolve_stream_from_api(call_state *cs, const DLPackExchangeAPI *api,
                                   const ragvit_tensor *t, const char *name) {
    if (cs->is_stream_resolved || t->device_type != RAGVIT_DEVICE_CUDA) return 0;
    void *stream = NULL;
    if (api->current_work_stream(kDLCUDA, t->device_id, &stream) != 0) {
        return raise_callback_failure(cs, name, "current_work_stream");
    }
    cs->stream = stream;
    cs->is_stream_resolved = 1;
    return 0;
}

/* Fills dl from an exchange-API argument; *mt (when not NULL) must be released. */
static int exchange_dltensor(call_state *cs, const import_slot *slot, const char *name,
                             DLTensor *dl, DLManagedTensorVersioned **mt) {
    const DLPackExchangeAPI *api = slot->api;
    *mt = NULL;
    if (api->dltensor_from_py_object_no_sync) {
        if (api->dltensor_from_py_object_no_sync(slot->obj, dl) != 0) {
            return raise_callback_failure(cs, name, "dltensor_from_py_object_no_sync");
        }
        return 0;
    }
    if (api->managed_tensor_from_py_object_no_sync(slot->obj, mt) != 0 || *mt == NULL) {
        *mt = NULL;
        return raise_callback_failure(cs, name, "managed_tensor_from_py_object_no_sync");
    }
    *dl = (*mt)->dl_tensor;
    return 0;
}

/* Before a __dlpack__ or CAI producer is asked in phase 1, the call's stream
 * must be known: the first CUDA exchange-API argument before it decides, as in
 * a one-pass import, else the legacy default stream. Only the C callbacks run. */
static int resolve_stream_early(call_state *cs, const char *const *names) {
    for (int i = 0; i < cs->slot_count && !cs->is_stream_resolved; i++) {
        const import_slot *slot = &cs->slots[i];
        if (slot->kind != IMPORT_EXCHANGE) continue;
        DLTensor dl;
        DLManagedTensorVersioned *mt;
        if (exchange_dltensor(cs, slot, names[slot->arg], &dl, &mt)) return -1;
        const int is_cuda =
            dl.device.device_type == kDLCUDA || dl.device.device_type == kDLCUDAManaged;
        const int32_t device_id = dl.device.device_id;
        if (mt && mt->deleter) mt->deleter(mt);
        if (is_cuda) {
            void *stream = NULL;
            if (slot->api->current_work_stream(kDLCUDA, device_id, &stream) != 0) {
                return raise_callback_failure(cs, names[slot->arg], "current_work_stream");
            }
            cs->stream = stream;
            cs->is_stream_resolved = 1;
        }
    }
    if (!cs->is_stream_resolved) {
        cs->stream = NULL;
        cs->is_stream_resolved = 1;
    }
    return 0;
}

/* ---- phase 1: the Python-level protocols ---- */

/* __dlpack_device__() -> (type, id), or -1 with an exception. */
static int query_dlpack_device(call_state *cs, PyObject *method, const char *name, int *type) {
    PyObject *dev = PyObject_CallNoArgs(method);
    if (dev == NULL) return -1;
    int ok = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2 &&
             PyLong_Check(PyTuple_GET_ITEM(dev, 0)); /* borrowed */
    if (ok) {
        *type = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 0)); /* borrowed */
        ok = !PyErr_Occurred();
    }
    Py_DECREF(dev);
    if (!ok) {
        PyErr_Clear();
        return raise_failure(ragvit_fail(
            RAGVIT_STATUS_NOT_IMPORTABLE,
            "%s: %s.__dlpack_device__() must return (device_type, device_id)", cs->op, name));
    }
    return 0;
}

/* Calls obj.__dlpack__ (method) and keeps the capsule in the slot; phase 2
 * checks and consumes it. */
static int prepare_dlpack(call_state *cs, PyObject *method, PyObject *device_method,
                          const char *const *names, const char *name, import_slot *slot) {
    module_state *st = cs->st;
    PyObject *kwargs = NULL, *stream_arg = NULL;
    int rc = -1, device_type = kDLCPU;
    slot->kind = IMPORT_DLPACK;
    if (query_dlpack_device(cs, device_method, name, &device_type)) goto done;
    if (device_type == kDLCUDA || device_type == kDLCUDAManaged) {
        if (!cs->is_stream_resolved && resolve_stream_early(cs, names)) goto done;
        /* DLPack spells the legacy default stream 1 (0 is disallowed). */
        stream_arg = PyLong_FromVoidPtr(cs->stream ? cs->stream : (void *)1);
    } else {
        stream_arg = Py_NewRef(Py_None);
    }
    if (stream_arg == NULL) goto done;
    kwargs = PyDict_New();
    if (kwargs == NULL || PyDict_SetItem(kwargs, st->str_stream, stream_arg) ||
        PyDict_SetItem(kwargs, st->str_max_version, st->max_version)) {
        goto done;
    }
    {
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL) goto done;
        slot->capsule = PyObject_Call(method, empty, kwargs);
        if (slot->capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* A producer older than DLPack 1.0 knows no max_version. */
            PyErr_Clear();
            if (PyDict_DelItem(kwargs, st->str_max_version) == 0) {
                slot->capsule = PyObject_Call(method, empty, kwargs);
            }
        }
        Py_DECREF(empty);
    }
    if (slot->capsule != NULL) rc = 0;
done:
    Py_XDECREF(kwargs);
    Py_XDECREF(stream_arg);
    return rc;
}

static int cai_dtype(const char *typestr, int32_t *dtype) {
    static const struct {
        const char *typestr;
        int32_t dtype;
    } table[] = {
        {"<f2", RAGVIT_DTYPE_F16}, {"<f4", RAGVIT_DTYPE_F32},  {"<f8", RAGVIT_DTYPE_F64},
        {"<i4", RAGVIT_DTYPE_I32}, {"<i8", RAGVIT_DTYPE_I64},  {"|u1", RAGVIT_DTYPE_U8},
        {"<u1", RAGVIT_DTYPE_U8},  {"|b1", RAGVIT_DTYPE_BOOL}, {"<b1", RAGVIT_DTYPE_BOOL},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(typestr, table[i].typestr) == 0) {
            *dtype = table[i].dtype;
            return 1;
        }
    }
    return 0;
}

/* Reads a tuple of ints into dst; -1 with an exception when malformed. */
static int read_int_tuple(call_state *cs, const char *name, const char *key, PyObject *tuple,
                          int64_t *dst, int expected) {
    if (!PyTuple_Check(tuple) || (expected >= 0 && PyTuple_GET_SIZE(tuple) != expected) ||
        PyTuple_GET_SIZE(tuple) > RAGVIT_MAX_DIMS) {
        return raise_failure(
            ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                        "%s: %s.__cuda_array_interface__['%s'] must be a tuple of at most %d ints",
                        cs->op, name, key, RAGVIT_MAX_DIMS));
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        dst[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i)); /* borrowed item */
        if (PyErr_Occurred()) return -1;
    }
    return (int)PyTuple_GET_SIZE(tuple);
}

/* CAI hands over a raw pointer (nothing to consume later), so its view is read
 * here, in phase 1, from the dict the producer returned. */
static int prepare_cai(call_state *cs, PyObject *cai, const char *const *names, const char *name,
                       ragvit_tensor *t, import_slot *slot) {
    slot->kind = IMPORT_CAI;
    if (!PyDict_Check(cai)) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                         "%s: %s.__cuda_array_interface__ must be a dict, got %s",
                                         cs->op, name, Py_TYPE(cai)->tp_name));
    }
    /* All borrowed from the dict. */
    PyObject *shape = PyDict_GetItemString(cai, "shape");
    PyObject *typestr = PyDict_GetItemString(cai, "typestr");
    PyObject *data = PyDict_GetItemString(cai, "data");
    PyObject *strides = PyDict_GetItemString(cai, "strides");
    PyObject *mask = PyDict_GetItemString(cai, "mask");
    PyObject *stream = PyDict_GetItemString(cai, "stream");
    if (!shape || !typestr || !PyUnicode_Check(typestr) || !data || !PyTuple_Check(data) ||
        PyTuple_GET_SIZE(data) != 2 || (mask && mask != Py_None)) {
        return raise_failure(
            ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                        "%s: %s.__cuda_array_interface__ must have shape, typestr and (ptr, "
                        "read_only) data and no mask",
                        cs->op, name));
    }
    const char *ts = PyUnicode_AsUTF8(typestr);
    if (ts == NULL) return -1;
    if (!cai_dtype(ts, &t->dtype)) {
        return raise_failure(ragvit_fail(
            RAGVIT_STATUS_INVALID_DTYPE,
            "%s: %s must have an unambiguous CUDA Array Interface typestr (<f2, <f4, <i4, "
            "|u1, |b1), got '%s' (bfloat16 cannot be told apart from other 2-byte "
            "types there: pass it through DLPack)",
            cs->op, name, ts));
    }
    int ndim = read_int_tuple(cs, name, "shape", shape, t->shape, -1);
    if (ndim < 0) return -1;
    t->ndim = ndim;
    int64_t elem = (t->dtype == RAGVIT_DTYPE_F16)                                   ? 2
                   : (t->dtype == RAGVIT_DTYPE_F64 || t->dtype == RAGVIT_DTYPE_I64) ? 8
                   : (t->dtype == RAGVIT_DTYPE_U8 || t->dtype == RAGVIT_DTYPE_BOOL) ? 1
                                                                                    : 4;
    if (strides && strides != Py_None) {
        if (read_int_tuple(cs, name, "strides", strides, t->strides, ndim) < 0) return -1;
        for (int i = 0; i < ndim; i++) {
            if (t->strides[i] % elem != 0) {
                return raise_failure(
                    ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                "%s: %s must have strides that are whole elements, got %lld bytes",
                                cs->op, name, (long long)t->strides[i]));
            }
            t->strides[i] /= elem;
        }
    } else {
        compact_strides(t);
    }
    t->data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0)); /* borrowed */
    if (t->data == NULL && PyErr_Occurred()) return -1;
    t->is_read_only = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (t->is_read_only < 0) return -1;
    t->device_type = RAGVIT_DEVICE_CUDA;
    t->device_id = 0;
    t->is_present = 1;
    if (finish_view(cs, name, t)) return -1;
    if (t->data != NULL && raise_status(ragvit_pointer_device(t->data, &t->device_id))) return -1;
    if (stream && stream != Py_None) {
        void *handle = PyLong_AsVoidPtr(stream);
        if (handle == NULL && PyErr_Occurred()) return -1;
        /* CAI v3: 1 is the legacy default stream, 2 the per-thread one. */
        if (handle == (void *)1) handle = NULL;
        if (cs->cai_stream_count < MAX_IMPORTS) {
            cs->cai_streams[cs->cai_stream_count] = handle;
            cs->cai_devices[cs->cai_stream_count] = t->device_id;
            cs->cai_stream_count++;
        }
    }
    return cs->is_stream_resolved ? 0 : resolve_stream_early(cs, names);
}

/* torch's negative bit (z.conj().imag, torch._neg_view) is a lazy negation that
 * no exchange protocol carries: the view would read the values without it. Asked
 * in debug mode only: torch's is_neg releases and retakes the GIL, about 800
 * instructions per tensor against about 8,600 for a whole five-tensor call. */
static int check_neg_bit(call_state *cs, PyObject *obj, const char *name) {
    PyObject *is_neg = PyObject_Vectorcall(cs->st->torch_is_neg, &obj, 1, NULL);
    if (is_neg == NULL) return -1;
    Py_DECREF(is_neg); /* Py_True or Py_False, which outlive it */
    if (is_neg != Py_True) return 0;
    return raise_failure(ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                     "%s: %s must not have torch's negative bit set (a lazily "
                                     "negated view, e.g. z.conj().imag), got one: call "
                                     ".resolve_neg() first",
                                     cs->op, name));
}

static int resolve_increment_version(module_state *st);

/* torch's grad mode, asked once per call (cs->grad_mode): 1 on, 0 off, -1 with
 * an exception set. */
static int ask_grad_mode(call_state *cs) {
    if (cs->grad_mode >= 0) return cs->grad_mode;
    module_state *st = cs->st;
    if (st->torch_is_grad_enabled == NULL && resolve_increment_version(st)) return -1;
    PyObject *fn = st->torch_is_grad_enabled;
    PyObject *is_grad_enabled = st->is_grad_enabled_c != NULL
                                    ? st->is_grad_enabled_c(PyCFunction_GET_SELF(fn), NULL)
                                    : PyObject_CallNoArgs(fn);
    if (is_grad_enabled == NULL) return -1;
    Py_DECREF(is_grad_enabled); /* Py_True or Py_False, which outlive it */
    cs->grad_mode = is_grad_enabled == Py_True;
    return cs->grad_mode;
}

/* ragvit's ops have no backward, so in grad mode a torch array that requires grad
 * is refused: read as an input, its gradient would stop at the output without a
 * word; written as an output, autograd would differentiate the values it held
 * before. Under torch.no_grad() or inference_mode, where inference runs (and
 * parameters still require grad), only the grad mode is asked: one call into torch
 * per call. */
static int check_no_grad(call_state *cs, PyObject *obj, const char *name) {
    const int grad_mode = ask_grad_mode(cs);
    if (grad_mode <= 0) return grad_mode;
    PyObject *requires_grad = PyObject_GetAttr(obj, cs->st->str_requires_grad);
    if (requires_grad == NULL) return -1;
    Py_DECREF(requires_grad); /* Py_True or Py_False, which outlive it */
    if (requires_grad != Py_True) return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "%s: %s requires grad and grad mode is on, but ragvit's ops have no "
                 "backward: call under torch.no_grad() or torch.inference_mode(), or pass "
                 "%s.detach()",
                 cs->op, name, name);
    return -1;
}

/* Phase 1 for obj (not NULL), argument `arg` of the signature: picks its
 * protocol and runs every Python-level part of it. */
static int prepare_arg(call_state *cs, PyObject *obj, int arg, const char *const *names,
                       ragvit_tensor *t) {
    module_state *st = cs->st;
    const char *name = names[arg];
    if (cs->slot_count >= MAX_IMPORTS) {
        PyErr_SetString(PyExc_RuntimeError, "ragvit: too many array arguments");
        return -1;
    }
    import_slot *slot = &cs->slots[cs->slot_count++];
    slot->kind = 0;
    slot->arg = arg;
    slot->obj = obj;
    slot->api = NULL;
    slot->capsule = NULL;
    slot->legacy = NULL;
    slot->versioned = NULL;
    if (Py_IS_TYPE(obj, st->buffer_type)) {
        slot->kind = IMPORT_BUFFER;
        return 0;
    }
    api_cache_entry scratch;
    const api_cache_entry *entry = type_entry(st, Py_TYPE(obj), &scratch);
    if (entry == NULL) return -1;
    if (entry->is_torch) {
        if (st->ctx.is_debug && st->torch_is_neg != NULL && check_neg_bit(cs, obj, name)) {
            return -1;
        }
        if (check_no_grad(cs, obj, name)) return -1;
        if (cs->sig->outputs & ARG_BIT(arg)) cs->written[cs->written_count++] = obj;
    }
    if (entry->api != NULL) {
        slot->kind = IMPORT_EXCHANGE;
        slot->api = entry->api;
        return 0;
    }
    if (PyArray_Check(obj)) {
        slot->kind = IMPORT_NUMPY;
        return 0;
    }
    PyObject *method = NULL, *device_method = NULL, *cai = NULL;
    int rc = -1;
    if (lookup_optional(obj, st->str_dlpack, &method) < 0) goto done;
    if (method != NULL && lookup_optional(obj, st->str_dlpack_device, &device_method) < 0) {
        goto done;
    }
    if (method != NULL && device_method != NULL) {
        rc = prepare_dlpack(cs, method, device_method, names, name, slot);
        goto done;
    }
    if (lookup_optional(obj, st->str_cai, &cai) < 0) goto done;
    if (cai != NULL) {
        rc = prepare_cai(cs, cai, names, name, t, slot);
        goto done;
    }
    raise_failure(
        ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                    "%s: %s must be an array (DLPack, CUDA Array Interface or NumPy), got %s",
                    cs->op, name, Py_TYPE(obj)->tp_name));
done:
    Py_XDECREF(method);
    Py_XDECREF(device_method);
    Py_XDECREF(cai);
    return rc;
}

/* ---- phase 2: raw views, no Python code ---- */

static int view_exchange(call_state *cs, import_slot *slot, const char *name, ragvit_tensor *t) {
    DLTensor dl;
    DLManagedTensorVersioned *mt;
    if (exchange_dltensor(cs, slot, name, &dl, &mt)) return -1;
    slot->versioned = mt; /* NULL on the stack-DLTensor path: nothing to release */
    const int is_read_only = mt != NULL && (mt->flags & RAGVIT_DLPACK_FLAG_READ_ONLY) != 0;
    if (raise_status(view_from_dl(t, &dl, is_read_only, cs->op, name)) ||
        finish_view(cs, name, t)) {
        return -1;
    }
    return resolve_stream_from_api(cs, slot->api, t, name);
}

static int view_numpy(call_state *cs, PyObject *obj, const char *name, ragvit_tensor *t) {
    PyArrayObject *arr = (PyArrayObject *)obj;
    int32_t dtype;
    switch (PyArray_TYPE(arr)) {
    case NPY_FLOAT16: dtype = RAGVIT_DTYPE_F16; break;
    case NPY_FLOAT32: dtype = RAGVIT_DTYPE_F32; break;
    case NPY_FLOAT64: dtype = RAGVIT_DTYPE_F64; break;
    case NPY_INT32: dtype = RAGVIT_DTYPE_I32; break;
    case NPY_INT64: dtype = RAGVIT_DTYPE_I64; break;
    case NPY_UINT8: dtype = RAGVIT_DTYPE_U8; break;
    case NPY_BOOL: dtype = RAGVIT_DTYPE_BOOL; break;
    default:
        return raise_failure(
            ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                        "%s: %s must be float16, float32, int32, uint8 or bool, got numpy dtype %s",
                        cs->op, name, PyArray_DESCR(arr)->typeobj->tp_name));
    }
    if (!PyArray_ISNOTSWAPPED(arr)) {
        return raise_failure(ragvit_fail(
            RAGVIT_STATUS_NOT_IMPORTABLE,
            "%s: %s must be in native byte order, got a byte-swapped array", cs->op, name));
    }
    int ndim = PyArray_NDIM(arr);
    if (ndim > RAGVIT_MAX_DIMS) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                         "%s: %s must have at most %d dimensions, got %d", cs->op,
                                         name, RAGVIT_MAX_DIMS, ndim));
    }
    const int is_empty = PyArray_SIZE(arr) == 0; /* strides checked below do not apply */
    npy_intp itemsize = PyArray_ITEMSIZE(arr);
    for (int i = 0; i < ndim; i++) {
        npy_intp stride = PyArray_STRIDE(arr, i);
        if (stride % itemsize != 0 && !is_empty) {
            return raise_failure(
                ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                            "%s: %s must have strides that are whole elements, got %zd bytes in "
                            "dimension %d",
                            cs->op, name, (Py_ssize_t)stride, i));
        }
        t->shape[i] = PyArray_DIM(arr, i);
        t->strides[i] = stride / itemsize;
    }
    t->ndim = ndim;
    t->dtype = dtype;
    t->data = PyArray_DATA(arr);
    t->device_type = RAGVIT_DEVICE_CPU;
    t->device_id = 0;
    t->is_read_only = !PyArray_ISWRITEABLE(arr);
    t->is_present = 1;
    return finish_view(cs, name, t);
}

static void view_buffer(ragvit_tensor *t, const buffer_object *b) {
    t->data = b->data;
    t->dtype = b->dtype;
    t->ndim = b->ndim;
    for (int i = 0; i < b->ndim; i++) {
        t->shape[i] = b->shape[i];
        t->strides[i] = b->strides[i];
    }
    t->device_type = b->device_type;
    t->device_id = b->device_id;
    t->is_read_only = 0;
    t->is_present = 1;
}

/* Once the call's stream is known: it waits on each CUDA Buffer argument's mark (the
 * point after its last known use); mark_buffers moves the mark past this call. */
static int finish_buffer_args(call_state *cs) {
    for (int j = 0; j < cs->slot_count; j++) {
        if (cs->slots[j].kind != IMPORT_BUFFER) continue;
        const buffer_object *b = (const buffer_object *)cs->slots[j].obj;
        if (b->device_type != RAGVIT_DEVICE_CUDA) continue;
        if (raise_status(ragvit_memory_wait(b->device_id, cs->stream, b->mark))) return -1;
    }
    return 0;
}

/* Checks and consumes the capsule phase 1 got; renamed only once accepted, so
 * a refused one is released by its own destructor. */
static int view_dlpack(call_state *cs, import_slot *slot, const char *name, ragvit_tensor *t) {
    PyObject *capsule = slot->capsule;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt =
            (DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (mt == NULL) return -1;
        if (mt->version.major != RAGVIT_DLPACK_MAJOR) {
            return raise_failure(
                ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                            "%s: %s must be a DLPack 1.x tensor, got version %u.%u", cs->op, name,
                            mt->version.major, mt->version.minor));
        }
        if (raise_status(view_from_dl(t, &mt->dl_tensor,
                                      (mt->flags & RAGVIT_DLPACK_FLAG_READ_ONLY) != 0, cs->op,
                                      name)) ||
            finish_view(cs, name, t) || PyCapsule_SetName(capsule, "used_dltensor_versioned")) {
            return -1;
        }
        slot->versioned = mt;
        return 0;
    }
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        if (mt == NULL) return -1;
        if (raise_status(view_from_dl(t, &mt->dl_tensor, 0, cs->op, name)) ||
            finish_view(cs, name, t) || PyCapsule_SetName(capsule, "used_dltensor")) {
            return -1;
        }
        slot->legacy = mt;
        return 0;
    }
    const char *cname = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
    PyErr_Clear();
    return raise_failure(
        ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                    "%s: %s.__dlpack__() must return an unconsumed DLPack capsule, got %s%s%s",
                    cs->op, name, cname ? "a capsule named '" : Py_TYPE(capsule)->tp_name,
                    cname ? cname : "", cname ? "'" : ""));
}

/* sig's fields are read once into locals: every import writes through cs and
 * t, which would otherwise make the compiler reload them each iteration. */
int call_import(call_state *cs, PyObject *const *values, ragvit_tensor *t) {
    const char *const *names = cs->sig->names;
    const unsigned arrays = cs->sig->arrays;
    if (parse_stream(cs, values[cs->sig->count - 1])) return -1;
    unsigned bits = arrays;
    for (int i = 0; bits != 0; i++, bits >>= 1) {
        if (!(bits & 1u)) continue;
        t[i].is_present = 0;
        if (values[i] != NULL && prepare_arg(cs, values[i], i, names, &t[i])) return -1;
    }
    const int count = cs->slot_count;
    int is_buffer_arg = 0;
    for (int j = 0; j < count; j++) {
        import_slot *slot = &cs->slots[j];
        const int i = slot->arg;
        int rc = 0;
        switch (slot->kind) {
        case IMPORT_EXCHANGE: rc = view_exchange(cs, slot, names[i], &t[i]); break;
        case IMPORT_NUMPY: rc = view_numpy(cs, slot->obj, names[i], &t[i]); break;
        case IMPORT_DLPACK: rc = view_dlpack(cs, slot, names[i], &t[i]); break;
        case IMPORT_BUFFER:
            view_buffer(&t[i], (const buffer_object *)slot->obj);
            rc = finish_view(cs, names[i], &t[i]);
            is_buffer_arg = 1;
            break;
        default: break; /* CAI: read in phase 1 */
        }
        if (rc) return -1;
    }
    return is_buffer_arg ? finish_buffer_args(cs) : 0;
}

/* A pending exception is set aside meanwhile: a deleter may run Python code. */
void release_slots(call_state *cs) {
    int is_owning = 0; /* the exchange fast path and NumPy own nothing */
    for (int i = 0; i < cs->slot_count; i++) {
        const import_slot *slot = &cs->slots[i];
        is_owning |= slot->capsule != NULL || slot->legacy != NULL || slot->versioned != NULL;
    }
    if (!is_owning) {
        cs->slot_count = 0;
        return;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (int i = 0; i < cs->slot_count; i++) {
        import_slot *slot = &cs->slots[i];
        if (slot->versioned && slot->versioned->deleter) slot->versioned->deleter(slot->versioned);
        if (slot->legacy && slot->legacy->deleter) slot->legacy->deleter(slot->legacy);
        Py_XDECREF(slot->capsule); /* unrenamed: its destructor releases the tensor */
        memset(slot, 0, sizeof *slot);
    }
    cs->slot_count = 0;
    PyErr_Restore(type, value, traceback);
}

/* ---- autograd: version counters of the torch outputs written ---- */

/* torch._C._increment_version, and whether it takes a tuple (torch >= 2.x
 * skips inference tensors there) or one tensor: an empty tuple tells, touching
 * no tensor; and torch._C.is_grad_enabled. torch is imported already: a torch
 * tensor was an argument. */
static int resolve_increment_version(module_state *st) {
    PyObject *name = PyUnicode_FromString("torch._C");
    if (name == NULL) return -1;
    PyObject *torch_c = PyImport_GetModule(name);
    Py_DECREF(name);
    if (torch_c == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "ragvit: torch._C is not imported");
        }
        return -1;
    }
    PyObject *fn = PyObject_GetAttrString(torch_c, "_increment_version");
    PyObject *is_grad_enabled = PyObject_GetAttrString(torch_c, "is_grad_enabled");
    Py_DECREF(torch_c);
    if (fn == NULL || is_grad_enabled == NULL) {
        Py_XDECREF(fn);
        Py_XDECREF(is_grad_enabled);
        return -1;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) {
        Py_DECREF(fn);
        Py_DECREF(is_grad_enabled);
        return -1;
    }
    PyObject *probe = PyObject_CallOneArg(fn, empty);
    Py_DECREF(empty);
    st->is_increment_version_iterable = probe != NULL;
    if (probe == NULL) PyErr_Clear();
    Py_XDECREF(probe);
    st->torch_increment_version = fn;
    st->torch_is_grad_enabled = is_grad_enabled;
    /* Called as CPython calls a METH_NOARGS function, without the generic call's
     * machinery: the function is asked on every call with a torch argument. */
    st->is_grad_enabled_c = NULL;
    if (PyCFunction_Check(is_grad_enabled) &&
        (PyCFunction_GET_FLAGS(is_grad_enabled) &
         (METH_VARARGS | METH_KEYWORDS | METH_NOARGS | METH_O | METH_FASTCALL | METH_METHOD)) ==
            METH_NOARGS) {
        st->is_grad_enabled_c = PyCFunction_GET_FUNCTION(is_grad_enabled);
    }
    return 0;
}

/* One call for all of them where torch takes a tuple, in grad mode only: the
 * call costs about 1,200 instructions (a seventh of a five-tensor attention
 * call) and under torch.no_grad() or inference_mode, where ragvit's inference
 * runs, no backward is being recorded. An inference tensor has no
 * version counter (nothing can have saved it for backward): the tuple form skips
 * it; the one-tensor form of older torch raises, which is cleared for it. */
int bump_versions(call_state *cs) {
    module_state *st = cs->st;
    const int n = cs->written_count;
    cs->written_count = 0;
    const int grad_mode = ask_grad_mode(cs);
    if (grad_mode <= 0) return grad_mode;
    if (st->is_increment_version_iterable) {
        PyObject *tensors = PyTuple_New(n);
        if (tensors == NULL) return -1;
        for (int i = 0; i < n; i++) PyTuple_SET_ITEM(tensors, i, Py_NewRef(cs->written[i]));
        PyObject *r = PyObject_Vectorcall(st->torch_increment_version, &tensors, 1, NULL);
        Py_DECREF(tensors);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    for (int i = 0; i < n; i++) {
        PyObject *r = PyObject_Vectorcall(st->torch_increment_version, &cs->written[i], 1, NULL);
        if (r == NULL) {
            PyObject *is_inference = PyObject_CallMethod(cs->written[i], "is_inference", NULL);
            const int skip = is_inference == Py_True;
            Py_XDECREF(is_inference);
            if (!skip) return -1;
            PyErr_Clear();
            continue;
        }
        Py_DECREF(r);
    }
    return 0;
}

/* ---- allocation in the caller's array library ---- */

/* The allocator's error callback: the producer's out-of-memory stays a
 * MemoryError, anything else is a BufferError (the output could not be made). */
static void exchange_set_error(void *error_ctx, const char *kind, const char *message) {
    (void)error_ctx;
    PyObject *type = (kind && strstr(kind, "Memory")) ? PyExc_MemoryError : PyExc_BufferError;
    PyErr_SetString(type, message ? message : "allocation failed");
}

PyObject *alloc_like(call_state *cs, const ragvit_tensor *like, const char *name, int32_t dtype,
                     int ndim, const int64_t *shape, ragvit_tensor *view) {
    const import_slot *slot = &cs->slots[0];
    if (slot->kind == IMPORT_EXCHANGE && slot->api->managed_tensor_allocator != NULL &&
        slot->api->managed_tensor_to_py_object_no_sync != NULL) {
        DLTensor proto;
        memset(&proto, 0, sizeof proto);
        proto.device.device_type = like->device_type == RAGVIT_DEVICE_CUDA ? kDLCUDA : kDLCPU;
        proto.device.device_id = like->device_id;
        proto.ndim = ndim;
        proto.dtype = dtype_to_dl(dtype);
        proto.shape = (int64_t *)shape;
        DLManagedTensorVersioned *mt = NULL;
        if (slot->api->managed_tensor_allocator(&proto, &mt, NULL, exchange_set_error) != 0 ||
            mt == NULL) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return NULL;
        }
        ragvit_status status = view_from_dl(view, &mt->dl_tensor, 0, cs->op, name);
        void *obj = NULL;
        /* Ownership of mt moves to the new object, even on failure. */
        if (slot->api->managed_tensor_to_py_object_no_sync(mt, &obj) != 0 || obj == NULL) {
            raise_callback_failure(cs, name, "managed_tensor_to_py_object_no_sync");
            return NULL;
        }
        if (status != RAGVIT_STATUS_OK) {
            Py_DECREF((PyObject *)obj);
            raise_status(status);
            return NULL;
        }
        if (finish_view(cs, name, view)) {
            Py_DECREF((PyObject *)obj);
            return NULL;
        }
        return (PyObject *)obj;
    }
    if (slot->kind == IMPORT_NUMPY && like->device_type == RAGVIT_DEVICE_CPU) {
        /* Every dtype NumPy has, so an op's own dtype check (which runs after this)
         * is what rejects an unsupported input, with its message. */
        int typenum = dtype == RAGVIT_DTYPE_F16    ? NPY_FLOAT16
                      : dtype == RAGVIT_DTYPE_F32  ? NPY_FLOAT32
                      : dtype == RAGVIT_DTYPE_F64  ? NPY_FLOAT64
                      : dtype == RAGVIT_DTYPE_I32  ? NPY_INT32
                      : dtype == RAGVIT_DTYPE_I64  ? NPY_INT64
                      : dtype == RAGVIT_DTYPE_U8   ? NPY_UINT8
                      : dtype == RAGVIT_DTYPE_BOOL ? NPY_BOOL
                                                   : -1;
        if (typenum >= 0) {
            npy_intp dims[RAGVIT_MAX_DIMS];
            for (int i = 0; i < ndim; i++) dims[i] = (npy_intp)shape[i];
            PyObject *arr = PyArray_SimpleNew(ndim, dims, typenum);
            if (arr == NULL) return NULL;
            if (view_numpy(cs, arr, name, view) != 0) {
                Py_DECREF(arr);
                return NULL;
            }
            return arr;
        }
    }
    PyObject *buffer = buffer_new(cs, like->device_type, like->device_id, dtype, ndim, shape);
    if (buffer == NULL) return NULL;
    view_buffer(view, (const buffer_object *)buffer);
    if (finish_view(cs, name, view)) {
        Py_DECREF(buffer);
        return NULL;
    }
    cs->wrap_arg = slot->obj;
    return buffer;
}

/* ---- CuPy: its ndarray built in C ---- */

/* A type's name without its module (tp_name holds both for static types). */
static const char *short_type_name(const PyTypeObject *type) {
    const char *dot = strrchr(type->tp_name, '.');
    return dot != NULL ? dot + 1 : type->tp_name;
}

/* Whether type is CuPy's ndarray: named ndarray in module cupy (cupy._core.core where the
 * ndarray is the extension type itself). Asked once per type, on a miss of the namespace
 * cache; nothing is imported. */
static int is_cupy_ndarray_type(PyTypeObject *type) {
    if (strcmp(short_type_name(type), "ndarray") != 0) return 0;
    PyObject *module = PyObject_GetAttrString((PyObject *)type, "__module__");
    const int is_cupy = module != NULL && PyUnicode_Check(module) &&
                        (PyUnicode_CompareWithASCIIString(module, "cupy") == 0 ||
                         PyUnicode_CompareWithASCIIString(module, "cupy._core.core") == 0);
    Py_XDECREF(module);
    PyErr_Clear();
    return is_cupy;
}

void cupy_state_clear(cupy_state *cupy) {
    Py_CLEAR(cupy->ndarray);
    cupy->base_new = NULL;
    cupy->stream_ptr = NULL;
    Py_CLEAR(cupy->init);
    Py_CLEAR(cupy->memory_pointer);
    Py_CLEAR(cupy->unowned_memory);
    Py_CLEAR(cupy->current_stream);
    Py_CLEAR(cupy->kw_memptr);
    Py_CLEAR(cupy->str_ptr);
    Py_CLEAR(cupy->empty_tuple);
    for (int i = 0; i < RAGVIT_DTYPE_COUNT; i++) Py_CLEAR(cupy->dtypes[i]);
}

int cupy_state_traverse(const cupy_state *cupy, visitproc visit, void *arg) {
    Py_VISIT(cupy->ndarray);
    Py_VISIT(cupy->init);
    Py_VISIT(cupy->memory_pointer);
    Py_VISIT(cupy->unowned_memory);
    Py_VISIT(cupy->current_stream);
    for (int i = 0; i < RAGVIT_DTYPE_COUNT; i++) Py_VISIT(cupy->dtypes[i]);
    return 0;
}

/* The attribute name of obj, or NULL with the error cleared. */
static PyObject *cupy_attr(PyObject *obj, const char *name) {
    PyObject *value = obj == NULL ? NULL : PyObject_GetAttrString(obj, name);
    if (value == NULL) PyErr_Clear();
    return value;
}

/* st->cupy for type, CuPy's ndarray, from the cupy module already imported: 1, or 0 (no
 * exception, st->cupy left empty) when CuPy lacks a piece: outputs take from_dlpack then.
 * CuPy (since 11) makes its ndarray in a Python __new__ that calls its extension base's
 * tp_new and then _init(shape, dtype, memptr); ragvit calls those two itself when the base
 * has _init, which skips the Python __new__ and __init__ frames and the keyword dict (about
 * half of the constructor's cost), else the public constructor. */
static int resolve_cupy(module_state *st, PyTypeObject *type) {
    cupy_state fresh;
    memset(&fresh, 0, sizeof fresh);
    PyObject *name = PyUnicode_FromString("cupy");
    PyObject *cupy = name == NULL ? NULL : PyImport_GetModule(name);
    Py_XDECREF(name);
    PyObject *cuda = cupy_attr(cupy, "cuda");
    PyObject *ndarray = cupy_attr(cupy, "ndarray");
    fresh.memory_pointer = cupy_attr(cuda, "MemoryPointer");
    fresh.unowned_memory = cupy_attr(cuda, "UnownedMemory");
    fresh.current_stream = cupy_attr(cuda, "get_current_stream");
    /* The C function CuPy's own modules call for the stream (Cython exports it by its
     * signature): a thread-local read instead of a Python call and an attribute. */
    name = PyUnicode_FromString("cupy_backends.cuda.stream");
    PyObject *backend = name == NULL ? NULL : PyImport_GetModule(name);
    Py_XDECREF(name);
    PyObject *capi = cupy_attr(backend, "__pyx_capi__");
    PyObject *capsule = capi != NULL && PyDict_Check(capi)
                            ? PyDict_GetItemString(capi, "get_stream_ptr") /* borrowed */
                            : NULL;
    if (capsule != NULL && PyCapsule_IsValid(capsule, "intptr_t (int)")) {
        fresh.stream_ptr = (intptr_t (*)(int))PyCapsule_GetPointer(capsule, "intptr_t (int)");
    }
    Py_XDECREF(capi);
    Py_XDECREF(backend);
    fresh.kw_memptr = Py_BuildValue("(s)", "memptr");
    fresh.str_ptr = PyUnicode_InternFromString("ptr");
    fresh.empty_tuple = PyTuple_New(0);
    PyTypeObject *base = type->tp_base;
    if (base != NULL && strcmp(short_type_name(base), "_ndarray_base") == 0 &&
        base->tp_new != NULL && base->tp_new != type->tp_new && base->tp_dict != NULL) {
        PyObject *init = PyDict_GetItemString(base->tp_dict, "_init"); /* borrowed */
        if (init != NULL && PyCallable_Check(init)) {
            fresh.init = Py_NewRef(init);
            fresh.base_new = base->tp_new;
        }
    }
    static const int typenums[RAGVIT_DTYPE_COUNT] = {
        [RAGVIT_DTYPE_F16] = NPY_FLOAT16, [RAGVIT_DTYPE_BF16] = -1,
        [RAGVIT_DTYPE_F32] = NPY_FLOAT32, [RAGVIT_DTYPE_I32] = NPY_INT32,
        [RAGVIT_DTYPE_I64] = NPY_INT64,   [RAGVIT_DTYPE_U8] = NPY_UINT8,
        [RAGVIT_DTYPE_BOOL] = NPY_BOOL,   [RAGVIT_DTYPE_F64] = NPY_FLOAT64,
    };
    for (int i = 0; i < RAGVIT_DTYPE_COUNT; i++) {
        if (typenums[i] >= 0) fresh.dtypes[i] = (PyObject *)PyArray_DescrFromType(typenums[i]);
    }
    const int is_complete = ndarray == (PyObject *)type && fresh.memory_pointer != NULL &&
                            fresh.unowned_memory != NULL && fresh.current_stream != NULL &&
                            fresh.kw_memptr != NULL && fresh.str_ptr != NULL &&
                            fresh.empty_tuple != NULL && fresh.dtypes[RAGVIT_DTYPE_F32] != NULL;
    PyErr_Clear();
    Py_XDECREF(cupy);
    Py_XDECREF(cuda);
    Py_XDECREF(ndarray);
    cupy_state_clear(&st->cupy);
    if (!is_complete) {
        cupy_state_clear(&fresh);
        return 0;
    }
    fresh.ndarray = (PyTypeObject *)Py_NewRef(type);
    st->cupy = fresh;
    return 1;
}

/* Whether b goes out as a cupy.ndarray built here: st->cupy describes type, and b's dtype
 * has a NumPy dtype (bfloat16 takes from_dlpack). */
static int cupy_route_applies(const module_state *st, PyTypeObject *type, const buffer_object *b) {
    return type == st->cupy.ndarray && st->cupy.dtypes[b->dtype] != NULL;
}

/* cupy.ndarray(shape, dtype, memptr=MemoryPointer(UnownedMemory(ptr, nbytes, b, device), 0))
 * over b's memory, compact in C order (CuPy's default strides). The UnownedMemory holds b, so
 * the Buffer lives as long as the array or any view of it. New reference, or NULL. */
static PyObject *cupy_array_over(const cupy_state *cupy, buffer_object *b) {
    PyObject *shape = NULL, *ptr = NULL, *nbytes = NULL, *device = NULL, *zero = NULL;
    PyObject *mem = NULL, *memptr = NULL, *array = NULL;
    shape = PyTuple_New(b->ndim);
    if (shape == NULL) goto done;
    for (int i = 0; i < b->ndim; i++) {
        PyObject *extent = PyLong_FromLongLong(b->shape[i]);
        if (extent == NULL) goto done;
        PyTuple_SET_ITEM(shape, i, extent); /* stolen */
    }
    ptr = PyLong_FromVoidPtr(b->data);
    nbytes = PyLong_FromSize_t(b->nbytes);
    device = PyLong_FromLong(b->device_id);
    zero = PyLong_FromLong(0);
    if (ptr == NULL || nbytes == NULL || device == NULL || zero == NULL) goto done;
    {
        PyObject *args[4] = {ptr, nbytes, (PyObject *)b, device}; /* all borrowed */
        mem = PyObject_Vectorcall(cupy->unowned_memory, args, 4, NULL);
    }
    if (mem == NULL) goto done;
    {
        PyObject *args[2] = {mem, zero}; /* borrowed */
        memptr = PyObject_Vectorcall(cupy->memory_pointer, args, 2, NULL);
    }
    if (memptr == NULL) goto done;
    PyObject *dtype = cupy->dtypes[b->dtype]; /* borrowed from the state */
    if (cupy->init != NULL) {
        array = cupy->base_new(cupy->ndarray, cupy->empty_tuple, NULL);
        if (array == NULL) goto done;
        PyObject *args[4] = {array, shape, dtype, memptr}; /* borrowed */
        PyObject *none = PyObject_Vectorcall(cupy->init, args, 4, NULL);
        if (none == NULL) Py_CLEAR(array);
        Py_XDECREF(none);
    } else {
        PyObject *args[3] = {shape, dtype, memptr}; /* borrowed; memptr by keyword */
        array = PyObject_Vectorcall((PyObject *)cupy->ndarray, args, 2, cupy->kw_memptr);
    }
done:
    Py_XDECREF(shape);
    Py_XDECREF(ptr);
    Py_XDECREF(nbytes);
    Py_XDECREF(device);
    Py_XDECREF(zero);
    Py_XDECREF(mem);
    Py_XDECREF(memptr);
    return array;
}

/* cudaStreamLegacy (1) and 0 name the same stream. */
static void *canonical_stream(void *stream) { return stream == (void *)1 ? NULL : stream; }

/* *stream: CuPy's current stream on device (0 for the legacy default one). */
static int cupy_current_stream(const cupy_state *cupy, int32_t device_id, void **stream) {
    if (cupy->stream_ptr != NULL) {
        /* entered with no exception set: one after the call is the function's */
        const intptr_t handle = cupy->stream_ptr((int)device_id);
        if (PyErr_Occurred()) return -1;
        *stream = (void *)handle;
        return 0;
    }
    PyObject *device = PyLong_FromLong(device_id);
    if (device == NULL) return -1;
    PyObject *current = PyObject_Vectorcall(cupy->current_stream, &device, 1, NULL);
    Py_DECREF(device);
    if (current == NULL) return -1;
    PyObject *ptr = PyObject_GetAttr(current, cupy->str_ptr);
    Py_DECREF(current);
    if (ptr == NULL) return -1;
    *stream = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    return *stream == NULL && PyErr_Occurred() ? -1 : 0;
}

PyObject *cupy_current_stream_of(module_state *st, int32_t device_id) {
    void *stream = NULL;
    if (st->cupy.ndarray == NULL) Py_RETURN_NONE;
    if (cupy_current_stream(&st->cupy, device_id, &stream)) return NULL;
    return PyLong_FromVoidPtr(stream);
}

/* Orders CuPy's current stream on b's device after the call: it waits on the call's mark
 * unless it is the call's own stream (already ordered after the launch). Once per call: the
 * outputs of a call share its mark. */
static int cupy_order_handoff(call_state *cs, const buffer_object *b) {
    if (cs->is_handoff_ordered) return 0;
    void *consumer = NULL;
    if (cupy_current_stream(&cs->st->cupy, b->device_id, &consumer)) return -1;
    if (canonical_stream(consumer) != canonical_stream(cs->stream) &&
        raise_status(ragvit_memory_wait(b->device_id, consumer, b->mark))) {
        return -1;
    }
    cs->is_handoff_ordered = 1;
    return 0;
}

PyObject *cupy_ndarray_like(module_state *st, PyObject *like, PyObject *buffer) {
    if (!Py_IS_TYPE(buffer, st->buffer_type)) {
        PyErr_Format(PyExc_TypeError, "_cupy_ndarray: buffer must be a ragvit.Buffer, got %s",
                     Py_TYPE(buffer)->tp_name);
        return NULL;
    }
    PyTypeObject *type = Py_TYPE(like);
    if (type != st->cupy.ndarray && is_cupy_ndarray_type(type)) resolve_cupy(st, type);
    if (!cupy_route_applies(st, type, (const buffer_object *)buffer)) Py_RETURN_NONE;
    return cupy_array_over(&st->cupy, (buffer_object *)buffer);
}

/* ---- outputs in the caller's array type ---- */

/* Whether entry still describes type: its weak reference is alive (a dead type's address
 * may be reused by a new one). */
static int namespace_entry_matches(const namespace_cache_entry *entry, PyTypeObject *type) {
    if (entry->type != type || entry->type_ref == NULL) return 0;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *referent = NULL;
    if (PyWeakref_GetRef(entry->type_ref, &referent) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(referent);
    return referent == (PyObject *)type;
#else
    return PyWeakref_GET_OBJECT(entry->type_ref) == (PyObject *)type; /* borrowed */
#endif
}

/* The from_dlpack of the package that defines type (CuPy's ndarray offers no
 * __array_namespace__, its package has from_dlpack): new reference, or NULL (none; no
 * exception). Only a package already imported is looked at. */
static PyObject *package_from_dlpack(module_state *st, PyTypeObject *type) {
    PyObject *module_name = PyObject_GetAttrString((PyObject *)type, "__module__");
    if (module_name == NULL || !PyUnicode_Check(module_name)) {
        Py_XDECREF(module_name);
        PyErr_Clear();
        return NULL;
    }
    const Py_ssize_t dot =
        PyUnicode_FindChar(module_name, '.', 0, PyUnicode_GetLength(module_name), 1);
    PyObject *package =
        dot >= 0 ? PyUnicode_Substring(module_name, 0, dot) : Py_NewRef(module_name);
    Py_DECREF(module_name);
    PyObject *module = package == NULL ? NULL : PyImport_GetModule(package);
    Py_XDECREF(package);
    PyObject *fn = NULL;
    if (module != NULL && lookup_optional(module, st->str_from_dlpack, &fn) < 0) fn = NULL;
    Py_XDECREF(module);
    if (fn != NULL && !PyCallable_Check(fn)) Py_CLEAR(fn);
    PyErr_Clear();
    return fn;
}

/* *from_dlpack (new reference, or NULL: neither an array namespace nor a defining package
 * with from_dlpack): the from_dlpack of obj's array namespace (__array_namespace__), else
 * of the package that defines its type, cached per type. A namespace's own exception
 * propagates (-1). */
static int namespace_from_dlpack(module_state *st, PyObject *obj, PyObject **from_dlpack) {
    PyTypeObject *type = Py_TYPE(obj);
    *from_dlpack = NULL;
    for (int i = 0; i < NAMESPACE_CACHE_SIZE; i++) {
        namespace_cache_entry *entry = &st->namespace_cache[i];
        if (namespace_entry_matches(entry, type)) {
            /* another CuPy-like type (a test's stand-in) was resolved since */
            if (entry->is_cupy && st->cupy.ndarray != type) entry->is_cupy = resolve_cupy(st, type);
            *from_dlpack = Py_XNewRef(entry->from_dlpack);
            return 0;
        }
    }
    const int is_cupy = is_cupy_ndarray_type(type) && resolve_cupy(st, type);
    PyObject *method = NULL, *ns = NULL, *fn = NULL;
    if (lookup_optional(obj, st->str_array_namespace, &method) < 0) return -1;
    if (method != NULL) {
        ns = PyObject_CallNoArgs(method);
        Py_DECREF(method);
        if (ns == NULL) return -1;
        const int found = lookup_optional(ns, st->str_from_dlpack, &fn);
        Py_DECREF(ns);
        if (found < 0) return -1;
    } else if (type != &PyBaseObject_Type) {
        fn = package_from_dlpack(st, type);
    }
    PyObject *type_ref = PyWeakref_NewRef((PyObject *)type, NULL);
    if (type_ref == NULL) {
        PyErr_Clear(); /* not cached: looked up again next time */
    } else {
        namespace_cache_entry *entry = &st->namespace_cache[st->namespace_cache_next];
        st->namespace_cache_next = (st->namespace_cache_next + 1) % NAMESPACE_CACHE_SIZE;
        Py_XDECREF(entry->type_ref);
        Py_XDECREF(entry->from_dlpack);
        entry->type = type;
        entry->type_ref = type_ref;
        entry->from_dlpack = Py_XNewRef(fn);
        entry->is_cupy = is_cupy;
    }
    *from_dlpack = fn;
    return 0;
}

/* Gives b the call's mark (*mark, recorded on the first CUDA Buffer's device; again when a
 * Buffer of another device follows, which the core then refuses). */
static int mark_buffer(call_state *cs, PyObject *obj, void **mark, int32_t *mark_device) {
    if (obj == NULL || !Py_IS_TYPE(obj, cs->st->buffer_type)) return 0;
    buffer_object *b = (buffer_object *)obj;
    /* a Buffer both read and written by the call holds its mark already */
    if (b->device_type != RAGVIT_DEVICE_CUDA || (*mark != NULL && b->mark == *mark)) return 0;
    if (*mark == NULL || b->device_id != *mark_device) {
        ragvit_memory_mark_release(*mark);
        *mark = NULL;
        if (raise_status(ragvit_memory_mark(b->device_id, cs->stream, mark))) return -1;
        *mark_device = b->device_id;
    }
    ragvit_memory_mark_retain(*mark);
    ragvit_memory_mark_release(b->mark);
    b->mark = *mark;
    return 0;
}

int mark_buffers(call_state *cs, PyObject *const *outputs, int count) {
    if (!cs->is_cuda) return 0;
    void *mark = NULL; /* the call's own reference, dropped at the end */
    int32_t mark_device = -1;
    int rc = 0;
    for (int i = 0; i < count && rc == 0; i++)
        rc = mark_buffer(cs, outputs[i], &mark, &mark_device);
    for (int j = 0; j < cs->slot_count && rc == 0; j++) {
        if (cs->slots[j].kind == IMPORT_BUFFER)
            rc = mark_buffer(cs, cs->slots[j].obj, &mark, &mark_device);
    }
    ragvit_memory_mark_release(mark);
    return rc;
}

/* A CUDA Buffer for a cupy.ndarray argument: the ndarray built here (the first such output
 * of a call resolves CuPy's constructors, through the namespace cache's miss). */
static PyObject *wrap_cupy(call_state *cs, buffer_object *b) {
    PyObject *array = NULL;
    if (cupy_order_handoff(cs, b) == 0) array = cupy_array_over(&cs->st->cupy, b);
    Py_DECREF(b);
    return array;
}

PyObject *wrap_output(call_state *cs, PyObject *obj) {
    module_state *st = cs->st;
    if (obj == NULL || !Py_IS_TYPE(obj, st->buffer_type) || cs->wrap_arg == NULL) return obj;
    buffer_object *b = (buffer_object *)obj;
    PyTypeObject *type = Py_TYPE(cs->wrap_arg);
    const int is_cuda = b->device_type == RAGVIT_DEVICE_CUDA;
    if (is_cuda && cupy_route_applies(st, type, b)) return wrap_cupy(cs, b);
    PyObject *from_dlpack = NULL;
    if (namespace_from_dlpack(st, cs->wrap_arg, &from_dlpack) < 0) {
        Py_DECREF(obj);
        return NULL;
    }
    if (is_cuda && cupy_route_applies(st, type, b)) { /* resolved by this lookup's miss */
        Py_XDECREF(from_dlpack);
        return wrap_cupy(cs, b);
    }
    if (from_dlpack == NULL) return obj;
    /* A consumer on the call's own stream is ordered after the launch already: its
     * __dlpack__ skips the wait on the mark (recorded there by mark_buffers). */
    b->is_handing_off = 1;
    b->handoff_stream = cs->stream;
    PyObject *wrapped = PyObject_Vectorcall(from_dlpack, &obj, 1, NULL);
    b->is_handing_off = 0;
    b->handoff_stream = NULL;
    Py_DECREF(from_dlpack);
    Py_DECREF(obj);
    return wrapped;
}
