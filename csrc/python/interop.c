/* interop.c — every way an argument becomes a ragvit_tensor view, and every
 * output ragvit allocates. Import order per argument: (1) the type's DLPack C
 * exchange API (`__dlpack_c_exchange_api__`, cached per type; fills a stack
 * DLTensor with no allocation), (2) NumPy arrays, (3) `__dlpack__` (versioned
 * capsules, then legacy), (4) `__cuda_array_interface__` v2/v3. Outputs come
 * from the first argument's library (exchange-API allocator) or NumPy on the host.
 * Decision: the hot path (torch tensors) never calls into Python: a type lookup
 * in a small cache, one C call per tensor, one current-stream query. */
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
        int64_t compact = 1;
        for (int i = dl->ndim - 1; i >= 0; i--) {
            t->shape[i] = dl->shape[i];
            t->strides[i] = compact;
            compact *= dl->shape[i];
        }
    }
    t->data = (char *)dl->data + dl->byte_offset;
    t->is_read_only = is_read_only;
    t->is_present = 1;
    return RAGVIT_STATUS_OK;
}

/* ---- per-type exchange API cache ---- */

static const DLPackExchangeAPI *exchange_api_for(module_state *st, PyTypeObject *type) {
    for (int i = 0; i < st->api_cache_count; i++) {
        if (st->api_cache[i].type == type) return st->api_cache[i].api;
    }
    const DLPackExchangeAPI *api = NULL;
    PyObject *attr = PyObject_GetAttr((PyObject *)type, st->str_exchange_api);
    if (attr == NULL) {
        PyErr_Clear();
    } else {
        if (PyCapsule_IsValid(attr, "dlpack_exchange_api")) {
            api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(attr, "dlpack_exchange_api");
        }
        /* The table must outlive the process (spec), so the capsule may go. */
        Py_DECREF(attr);
        if (api &&
            (api->header.version.major != RAGVIT_DLPACK_MAJOR || api->current_work_stream == NULL ||
             api->managed_tensor_from_py_object_no_sync == NULL)) {
            api = NULL;
        }
    }
    if (st->api_cache_count < API_CACHE_SIZE) {
        Py_INCREF(type);
        st->api_cache[st->api_cache_count].type = type;
        st->api_cache[st->api_cache_count].api = api;
        st->api_cache_count++;
    }
    return api;
}

/* ---- importers ---- */

static int resolve_stream_from_api(call_state *cs, const DLPackExchangeAPI *api,
                                   const ragvit_tensor *t) {
    if (cs->is_stream_resolved || t->device_type != RAGVIT_DEVICE_CUDA) return 0;
    void *stream = NULL;
    if (api->current_work_stream(kDLCUDA, t->device_id, &stream) != 0) return -1;
    cs->stream = stream;
    cs->is_stream_resolved = 1;
    return 0;
}

static int import_exchange(call_state *cs, PyObject *obj, const char *name, ragvit_tensor *t,
                           const DLPackExchangeAPI *api, import_slot *slot) {
    slot->kind = IMPORT_EXCHANGE;
    slot->api = api;
    if (api->dltensor_from_py_object_no_sync) {
        DLTensor dl;
        if (api->dltensor_from_py_object_no_sync(obj, &dl) != 0) return -1;
        if (raise_status(view_from_dl(t, &dl, 0, cs->op, name))) return -1;
    } else {
        DLManagedTensorVersioned *mt = NULL;
        if (api->managed_tensor_from_py_object_no_sync(obj, &mt) != 0) return -1;
        slot->versioned = mt;
        if (raise_status(view_from_dl(t, &mt->dl_tensor,
                                      (mt->flags & RAGVIT_DLPACK_FLAG_READ_ONLY) != 0, cs->op,
                                      name))) {
            return -1;
        }
    }
    return resolve_stream_from_api(cs, api, t);
}

static int import_numpy(call_state *cs, PyObject *obj, const char *name, ragvit_tensor *t,
                        import_slot *slot) {
    PyArrayObject *arr = (PyArrayObject *)obj;
    int32_t dtype;
    slot->kind = IMPORT_NUMPY;
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
    npy_intp itemsize = PyArray_ITEMSIZE(arr);
    for (int i = 0; i < ndim; i++) {
        npy_intp stride = PyArray_STRIDE(arr, i);
        if (stride % itemsize != 0) {
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
    return 0;
}

/* __dlpack_device__() -> (type, id), or -1 with an exception. */
static int query_dlpack_device(call_state *cs, PyObject *obj, const char *name, int *type) {
    PyObject *dev = PyObject_CallMethodNoArgs(obj, cs->st->str_dlpack_device);
    if (dev == NULL) return -1;
    int ok = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2;
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

static int import_dlpack(call_state *cs, PyObject *obj, const char *name, ragvit_tensor *t,
                         import_slot *slot) {
    module_state *st = cs->st;
    PyObject *method = NULL, *kwargs = NULL, *capsule = NULL, *stream_arg = NULL;
    int rc = -1, device_type = kDLCPU;
    slot->kind = IMPORT_DLPACK;
    if (query_dlpack_device(cs, obj, name, &device_type)) goto done;
    if (device_type == kDLCUDA || device_type == kDLCUDAManaged) {
        if (!cs->is_stream_resolved) {
            cs->stream = NULL;
            cs->is_stream_resolved = 1;
        }
        /* DLPack spells the legacy default stream 1 (0 is disallowed). */
        stream_arg = PyLong_FromVoidPtr(cs->stream ? cs->stream : (void *)1);
    } else {
        stream_arg = Py_None;
        Py_INCREF(stream_arg);
    }
    if (stream_arg == NULL) goto done;
    method = PyObject_GetAttr(obj, st->str_dlpack);
    if (method == NULL) goto done;
    kwargs = PyDict_New();
    if (kwargs == NULL || PyDict_SetItem(kwargs, st->str_stream, stream_arg) ||
        PyDict_SetItem(kwargs, st->str_max_version, st->max_version)) {
        goto done;
    }
    {
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL) goto done;
        capsule = PyObject_Call(method, empty, kwargs);
        if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* A producer older than DLPack 1.0 knows no max_version. */
            PyErr_Clear();
            if (PyDict_DelItem(kwargs, st->str_max_version) == 0) {
                capsule = PyObject_Call(method, empty, kwargs);
            }
        }
        Py_DECREF(empty);
    }
    if (capsule == NULL) goto done;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt =
            (DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (mt->version.major != RAGVIT_DLPACK_MAJOR) {
            raise_failure(ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                      "%s: %s must be a DLPack 1.x tensor, got version %u.%u",
                                      cs->op, name, mt->version.major, mt->version.minor));
            goto done;
        }
        if (raise_status(view_from_dl(t, &mt->dl_tensor,
                                      (mt->flags & RAGVIT_DLPACK_FLAG_READ_ONLY) != 0, cs->op,
                                      name))) {
            goto done;
        }
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned")) goto done;
        slot->versioned = mt;
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        if (raise_status(view_from_dl(t, &mt->dl_tensor, 0, cs->op, name))) goto done;
        if (PyCapsule_SetName(capsule, "used_dltensor")) goto done;
        slot->legacy = mt;
    } else {
        const char *cname = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
        PyErr_Clear();
        raise_failure(
            ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                        "%s: %s.__dlpack__() must return an unconsumed DLPack capsule, got %s%s%s",
                        cs->op, name, cname ? "a capsule named '" : Py_TYPE(capsule)->tp_name,
                        cname ? cname : "", cname ? "'" : ""));
        goto done;
    }
    slot->capsule = capsule; /* stolen: released by release_slots */
    capsule = NULL;
    rc = 0;
done:
    Py_XDECREF(capsule); /* an unrenamed capsule's destructor calls the deleter */
    Py_XDECREF(kwargs);
    Py_XDECREF(method);
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

static int import_cai(call_state *cs, PyObject *cai, const char *name, ragvit_tensor *t,
                      import_slot *slot) {
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
        int64_t compact = 1;
        for (int i = ndim - 1; i >= 0; i--) {
            t->strides[i] = compact;
            compact *= t->shape[i];
        }
    }
    t->data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0)); /* borrowed */
    if (t->data == NULL && PyErr_Occurred()) return -1;
    t->is_read_only = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (t->is_read_only < 0) return -1;
    t->device_type = RAGVIT_DEVICE_CUDA;
    t->device_id = 0;
    t->is_present = 1;
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
    if (!cs->is_stream_resolved) {
        cs->stream = NULL;
        cs->is_stream_resolved = 1;
    }
    return 0;
}

/* Imports obj (NULL: optional argument left out) into t. */
static int import_arg(call_state *cs, PyObject *obj, const char *name, ragvit_tensor *t) {
    t->is_present = 0;
    if (obj == NULL) return 0;
    if (cs->slot_count >= MAX_IMPORTS) {
        PyErr_SetString(PyExc_RuntimeError, "ragvit: too many array arguments");
        return -1;
    }
    import_slot *slot = &cs->slots[cs->slot_count++];
    memset(slot, 0, sizeof *slot);
    slot->type = Py_TYPE(obj);
    const DLPackExchangeAPI *api = exchange_api_for(cs->st, Py_TYPE(obj));
    if (api) return import_exchange(cs, obj, name, t, api, slot);
    if (PyArray_Check(obj)) return import_numpy(cs, obj, name, t, slot);
    if (PyObject_HasAttr(obj, cs->st->str_dlpack) &&
        PyObject_HasAttr(obj, cs->st->str_dlpack_device)) {
        return import_dlpack(cs, obj, name, t, slot);
    }
    PyObject *cai = PyObject_GetAttr(obj, cs->st->str_cai);
    if (cai != NULL) {
        int rc = import_cai(cs, cai, name, t, slot);
        Py_DECREF(cai);
        return rc;
    }
    PyErr_Clear();
    return raise_failure(
        ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                    "%s: %s must be an array (DLPack, CUDA Array Interface or NumPy), got %s",
                    cs->op, name, Py_TYPE(obj)->tp_name));
}

/* sig's fields are read once into locals: every import writes through cs and
 * t, which would otherwise make the compiler reload them each iteration. */
int call_import(call_state *cs, PyObject *const *values, ragvit_tensor *t) {
    const char *const *names = cs->sig->names;
    unsigned arrays = cs->sig->arrays;
    if (parse_stream(cs, values[cs->sig->count - 1])) return -1;
    for (int i = 0; arrays != 0; i++, arrays >>= 1) {
        if ((arrays & 1u) && import_arg(cs, values[i], names[i], &t[i])) return -1;
    }
    return 0;
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
        Py_XDECREF(slot->capsule);
        memset(slot, 0, sizeof *slot);
    }
    cs->slot_count = 0;
    PyErr_Restore(type, value, traceback);
}

/* ---- allocation in the caller's array library ---- */

static void exchange_set_error(void *error_ctx, const char *kind, const char *message) {
    (void)error_ctx;
    PyObject *type = (kind && strstr(kind, "Memory")) ? PyExc_MemoryError : PyExc_RuntimeError;
    PyErr_SetString(type, message ? message : "allocation failed");
}

PyObject *alloc_like(call_state *cs, const ragvit_tensor *like, const char *name, int32_t dtype,
                     int ndim, const int64_t *shape, ragvit_tensor *view) {
    const import_slot *slot = &cs->slots[0];
    if (slot->kind == IMPORT_EXCHANGE) {
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
        if (slot->api->managed_tensor_to_py_object_no_sync(mt, &obj) != 0) return NULL;
        if (status != RAGVIT_STATUS_OK) {
            Py_XDECREF((PyObject *)obj);
            raise_status(status);
            return NULL;
        }
        return (PyObject *)obj;
    }
    if (like->device_type == RAGVIT_DEVICE_CPU) {
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
        if (typenum < 0) {
            raise_failure(
                ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                            "%s: %s must be given (out=) for bfloat16 host arrays, got none (NumPy "
                            "has no bfloat16)",
                            cs->op, name));
            return NULL;
        }
        npy_intp dims[RAGVIT_MAX_DIMS];
        for (int i = 0; i < ndim; i++) dims[i] = (npy_intp)shape[i];
        PyObject *arr = PyArray_SimpleNew(ndim, dims, typenum);
        if (arr == NULL) return NULL;
        if (import_numpy(cs, arr, name, view, &(import_slot){0}) != 0) {
            Py_DECREF(arr);
            return NULL;
        }
        return arr;
    }
    raise_failure(
        ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                    "%s: %s must be given for CUDA inputs of type %s, got none (the type offers no "
                    "DLPack exchange API allocator)",
                    cs->op, name, slot->type->tp_name));
    return NULL;
}
