/* buffer.c — ragvit.Buffer: an output ragvit allocated itself because the caller's array
 * library offers no allocator. A compact array (shape, dtype, device) exported zero-copy
 * through __dlpack__ (versioned capsules for DLPack 1.x consumers, legacy ones for older
 * ones; stream= per the array API standard), __dlpack_device__, __cuda_array_interface__ v3
 * (CUDA) and __array_interface__ (host). Memory: core/memory.c (CUDA: stream-ordered).
 * Decision: the buffer keeps a mark (a pooled CUDA event, shared by the buffers of one call)
 * after its last known use: the launch that wrote it, then every ragvit call that read it (glue
 * mark_buffers). Consumers' streams wait on the mark (but for the hand-off to the caller's
 * array type on the call's own stream, which is ordered already), CUDA Array Interface consumers
 * get ragvit's own stream made to wait on it, and the free is ordered after it on that stream: no
 * caller's stream is touched after the call that named it, since a caller may destroy its stream
 * before the buffer goes. Work a consumer queues on its own stream after the hand-off is the
 * consumer's to finish before it drops the array, as with any DLPack producer. Tests:
 * tests/test_array_types.py. The type itself (methods, docstrings) is declared in module.c. */
#include "glue.h"

/* ---- dtype facts ---- */

static const struct {
    const char *name;
    const char *typestr; /* NULL: no array-interface typestr tells it apart (bfloat16) */
    uint8_t code;
    uint8_t bits;
} buffer_dtypes[RAGVIT_DTYPE_COUNT] = {
    [RAGVIT_DTYPE_F16] = {"float16", "<f2", kDLFloat, 16},
    [RAGVIT_DTYPE_BF16] = {"bfloat16", NULL, kDLBfloat, 16},
    [RAGVIT_DTYPE_F32] = {"float32", "<f4", kDLFloat, 32},
    [RAGVIT_DTYPE_I32] = {"int32", "<i4", kDLInt, 32},
    [RAGVIT_DTYPE_I64] = {"int64", "<i8", kDLInt, 64},
    [RAGVIT_DTYPE_U8] = {"uint8", "|u1", kDLUInt, 8},
    [RAGVIT_DTYPE_BOOL] = {"bool", "|b1", kDLBool, 8},
    [RAGVIT_DTYPE_F64] = {"float64", "<f8", kDLFloat, 64},
};

/* ---- creation and release ---- */

PyObject *buffer_new(call_state *cs, int32_t device_type, int32_t device_id, int32_t dtype,
                     int ndim, const int64_t *shape) {
    PyTypeObject *type = cs->st->buffer_type;
    buffer_object *self = (buffer_object *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) return NULL;
    self->device_type = device_type;
    self->device_id = device_type == RAGVIT_DEVICE_CUDA ? device_id : 0;
    self->dtype = dtype;
    self->ndim = ndim;
    size_t bytes = buffer_dtypes[dtype].bits / 8;
    for (int i = ndim - 1; i >= 0; i--) {
        self->shape[i] = shape[i];
        self->strides[i] =
            i == ndim - 1 ? 1 : self->strides[i + 1] * (shape[i + 1] > 0 ? shape[i + 1] : 1);
        if (shape[i] != 0 && bytes > SIZE_MAX / 2 / (size_t)shape[i]) {
            Py_DECREF(self);
            raise_failure(ragvit_fail(RAGVIT_STATUS_OUT_OF_MEMORY,
                                      "%s: an output of %d dimensions is too large to allocate",
                                      cs->op, ndim));
            return NULL;
        }
        bytes *= (size_t)shape[i];
    }
    for (int i = 0; i < ndim; i++) {
        if (self->shape[i] == 0) bytes = 0;
    }
    self->nbytes = bytes;
    if (raise_status(ragvit_memory_alloc(&cs->st->ctx, device_type, device_id, bytes, cs->stream,
                                         &self->data))) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* A failing free cannot be raised from a deallocator: a CUDA error it meets is sticky and
 * the next CUDA call reports it. */
void buffer_dealloc(PyObject *obj) {
    buffer_object *self = (buffer_object *)obj;
    PyTypeObject *type = Py_TYPE(obj);
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs(obj);
    (void)ragvit_memory_free(self->device_type, self->device_id, self->data, self->nbytes,
                             self->mark);
    self->mark = NULL;
    self->data = NULL;
    type->tp_free(obj);
    Py_DECREF(type); /* instances of a heap type hold a reference to it */
}

/* ---- DLPack export ---- */

/* The capsule's manager_ctx holds a reference to the buffer; a deleter may be called
 * without the GIL (by a consumer's own thread), so it takes it. */
static void buffer_release_ctx(void *ctx) {
    if (!Py_IsInitialized()) return; /* at exit: the process frees everything */
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF((PyObject *)ctx);
    PyGILState_Release(gil);
}

static void buffer_versioned_deleter(DLManagedTensorVersioned *mt) {
    buffer_release_ctx(mt->manager_ctx);
    PyMem_RawFree(mt);
}

static void buffer_legacy_deleter(DLManagedTensor *mt) {
    buffer_release_ctx(mt->manager_ctx);
    PyMem_RawFree(mt);
}

/* An unconsumed capsule (still named "dltensor*") owns its tensor. */
static void buffer_versioned_capsule_destructor(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor_versioned")) return;
    DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (mt != NULL && mt->deleter != NULL) mt->deleter(mt);
}

static void buffer_legacy_capsule_destructor(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor")) return;
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
    if (mt != NULL && mt->deleter != NULL) mt->deleter(mt);
}

static void buffer_fill_dltensor(buffer_object *self, DLTensor *dl) {
    dl->data = self->data;
    dl->device.device_type = self->device_type == RAGVIT_DEVICE_CUDA ? kDLCUDA : kDLCPU;
    dl->device.device_id = self->device_id;
    dl->ndim = self->ndim;
    dl->dtype.code = buffer_dtypes[self->dtype].code;
    dl->dtype.bits = buffer_dtypes[self->dtype].bits;
    dl->dtype.lanes = 1;
    dl->shape = self->shape;
    dl->strides = self->strides;
    dl->byte_offset = 0;
}

static int buffer_fail(ragvit_status status, const char *fmt, PyObject *got) {
    PyObject *repr = PyObject_Repr(got);
    if (repr == NULL) return -1;
    const char *text = PyUnicode_AsUTF8(repr);
    const int rc = text == NULL ? -1 : raise_failure(ragvit_fail(status, fmt, text));
    Py_DECREF(repr);
    return rc;
}

/* stream= of __dlpack__: *consumer and *is_sync (0 for -1, "no synchronization", and for
 * host buffers). The array API standard's CUDA values: None the legacy default stream,
 * 1 the same, 2 the per-thread default stream, larger ints a stream handle, 0 refused
 * (it could mean any of the three). */
static int buffer_consumer_stream(buffer_object *self, PyObject *obj, void **consumer,
                                  int *is_sync) {
    *consumer = NULL;
    *is_sync = 0;
    const int is_cuda = self->device_type == RAGVIT_DEVICE_CUDA;
    if (obj == NULL || obj == Py_None) {
        *is_sync = is_cuda;
        return 0;
    }
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                                         "Buffer.__dlpack__: stream must be an int or None, got %s",
                                         Py_TYPE(obj)->tp_name));
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value == -1 && !overflow) return 0;
    if (!is_cuda) {
        return buffer_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "Buffer.__dlpack__: stream must be None or -1 for a host buffer, got %s",
                           obj);
    }
    if (overflow || value <= 0) {
        return buffer_fail(RAGVIT_STATUS_INVALID_VALUE,
                           "Buffer.__dlpack__: stream must be None, -1, 1 (legacy default), 2 "
                           "(per-thread default) or a CUDA stream handle, got %s",
                           obj);
    }
    *consumer = value == 1 ? NULL : PyLong_AsVoidPtr(obj);
    if (*consumer == NULL && PyErr_Occurred()) return -1;
    *is_sync = 1;
    return 0;
}

/* max_version=: 1 for a versioned capsule (*minor: the minor version to report), 0 for a
 * legacy one (absent or None: a consumer older than DLPack 1.0). */
static int buffer_max_version(PyObject *obj, int *is_versioned, uint32_t *minor) {
    *is_versioned = 0;
    *minor = 0;
    if (obj == NULL || obj == Py_None) return 0;
    long major = -1, consumer_minor = -1;
    if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 2 &&
        PyLong_Check(PyTuple_GET_ITEM(obj, 0)) && PyLong_Check(PyTuple_GET_ITEM(obj, 1))) {
        major = PyLong_AsLong(PyTuple_GET_ITEM(obj, 0));          /* borrowed */
        consumer_minor = PyLong_AsLong(PyTuple_GET_ITEM(obj, 1)); /* borrowed */
        if (PyErr_Occurred()) return -1;
    }
    if (major < 0 || consumer_minor < 0) {
        return buffer_fail(RAGVIT_STATUS_INVALID_TYPE,
                           "Buffer.__dlpack__: max_version must be None or a (major, minor) "
                           "tuple of non-negative ints, got %s",
                           obj);
    }
    if (major < RAGVIT_DLPACK_MAJOR) return 0;
    *is_versioned = 1;
    *minor = major > RAGVIT_DLPACK_MAJOR || consumer_minor > RAGVIT_DLPACK_MINOR
                 ? RAGVIT_DLPACK_MINOR
                 : (uint32_t)consumer_minor;
    return 0;
}

/* dl_device= must name the buffer's own device (ragvit does not copy); copy=True is refused
 * for the same reason (BufferError, as the standard asks of a producer that cannot). */
static int buffer_check_export(buffer_object *self, PyObject *dl_device, PyObject *copy) {
    if (dl_device != NULL && dl_device != Py_None) {
        const long own_type = self->device_type == RAGVIT_DEVICE_CUDA ? kDLCUDA : kDLCPU;
        int ok = PyTuple_Check(dl_device) && PyTuple_GET_SIZE(dl_device) == 2;
        if (ok) {
            const long type = PyLong_AsLong(PyTuple_GET_ITEM(dl_device, 0)); /* borrowed */
            const long id = PyLong_AsLong(PyTuple_GET_ITEM(dl_device, 1));   /* borrowed */
            if (PyErr_Occurred()) return -1;
            ok = type == own_type && id == self->device_id;
        }
        if (!ok) {
            return buffer_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                               "Buffer.__dlpack__: dl_device must be the buffer's own device "
                               "(ragvit.Buffer does not copy), got %s",
                               dl_device);
        }
    }
    if (copy != NULL && copy != Py_None) {
        const int is_copy = PyObject_IsTrue(copy);
        if (is_copy < 0) return -1;
        if (is_copy) {
            return raise_failure(ragvit_fail(RAGVIT_STATUS_NOT_IMPORTABLE,
                                             "Buffer.__dlpack__: copy must be None or False, got "
                                             "True (ragvit.Buffer is exported without a copy)"));
        }
    }
    return 0;
}

PyObject *buffer_dlpack(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"stream", "max_version", "dl_device", "copy"};
    enum { STREAM, MAX_VERSION, DL_DEVICE, COPY, NUM_ARGS };
    buffer_object *self = (buffer_object *)obj;
    PyObject *values[NUM_ARGS] = {NULL, NULL, NULL, NULL}; /* borrowed */
    if (nargs != 0) {
        PyErr_Format(PyExc_TypeError,
                     "Buffer.__dlpack__() takes keyword arguments only, got %zd positional", nargs);
        return NULL;
    }
    const Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i); /* borrowed */
        const int at = keyword_index(key, names, NUM_ARGS);
        if (at < 0) {
            PyErr_Format(PyExc_TypeError, "Buffer.__dlpack__() got an unexpected keyword %R", key);
            return NULL;
        }
        values[at] = args[i];
    }
    void *consumer = NULL;
    int is_sync = 0, is_versioned = 0;
    uint32_t minor = 0;
    if (buffer_consumer_stream(self, values[STREAM], &consumer, &is_sync) ||
        buffer_max_version(values[MAX_VERSION], &is_versioned, &minor) ||
        buffer_check_export(self, values[DL_DEVICE], values[COPY])) {
        return NULL;
    }
    const int is_ordered = self->is_handing_off && consumer == self->handoff_stream;
    if (is_sync && !is_ordered &&
        raise_status(ragvit_memory_wait(self->device_id, consumer, self->mark))) {
        return NULL;
    }
    PyObject *capsule = NULL;
    if (is_versioned) {
        DLManagedTensorVersioned *mt = PyMem_RawMalloc(sizeof *mt);
        if (mt == NULL) return PyErr_NoMemory();
        mt->version.major = RAGVIT_DLPACK_MAJOR;
        mt->version.minor = minor;
        mt->manager_ctx = Py_NewRef(obj);
        mt->deleter = buffer_versioned_deleter;
        mt->flags = 0;
        buffer_fill_dltensor(self, &mt->dl_tensor);
        capsule = PyCapsule_New(mt, "dltensor_versioned", buffer_versioned_capsule_destructor);
        if (capsule == NULL) buffer_versioned_deleter(mt);
    } else {
        DLManagedTensor *mt = PyMem_RawMalloc(sizeof *mt);
        if (mt == NULL) return PyErr_NoMemory();
        mt->manager_ctx = Py_NewRef(obj);
        mt->deleter = buffer_legacy_deleter;
        buffer_fill_dltensor(self, &mt->dl_tensor);
        capsule = PyCapsule_New(mt, "dltensor", buffer_legacy_capsule_destructor);
        if (capsule == NULL) buffer_legacy_deleter(mt);
    }
    return capsule;
}

PyObject *buffer_dlpack_device(PyObject *obj, PyObject *unused) {
    (void)unused;
    const buffer_object *self = (const buffer_object *)obj;
    return Py_BuildValue("(ii)", self->device_type == RAGVIT_DEVICE_CUDA ? kDLCUDA : kDLCPU,
                         (int)self->device_id);
}

/* ---- attributes ---- */

static PyObject *buffer_shape_tuple(const buffer_object *self) {
    PyObject *shape = PyTuple_New(self->ndim);
    if (shape == NULL) return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *extent = PyLong_FromLongLong(self->shape[i]);
        if (extent == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, extent); /* stolen */
    }
    return shape;
}

PyObject *buffer_get_shape(PyObject *obj, void *unused) {
    (void)unused;
    return buffer_shape_tuple((const buffer_object *)obj);
}

PyObject *buffer_get_ndim(PyObject *obj, void *unused) {
    (void)unused;
    return PyLong_FromLong(((const buffer_object *)obj)->ndim);
}

PyObject *buffer_get_dtype(PyObject *obj, void *unused) {
    (void)unused;
    return PyUnicode_FromString(buffer_dtypes[((const buffer_object *)obj)->dtype].name);
}

/* The array interface dict of both protocols (version 3, compact: strides None). */
static PyObject *buffer_interface(const buffer_object *self, int is_cuda, const char *protocol) {
    const char *typestr = buffer_dtypes[self->dtype].typestr;
    if ((self->device_type == RAGVIT_DEVICE_CUDA) != is_cuda || typestr == NULL) {
        PyErr_Format(PyExc_AttributeError, "a %s %s ragvit.Buffer has no %s (use __dlpack__)",
                     self->device_type == RAGVIT_DEVICE_CUDA ? "CUDA" : "host",
                     buffer_dtypes[self->dtype].name, protocol);
        return NULL;
    }
    PyObject *shape = buffer_shape_tuple(self);
    if (shape == NULL) return NULL;
    PyObject *dict =
        Py_BuildValue("{sNsss(NO)sisO}", "shape", shape, "typestr", typestr, "data",
                      PyLong_FromVoidPtr(self->data), Py_False, "version", 3, "strides", Py_None);
    if (dict == NULL || !is_cuda) return dict;
    /* ragvit's own stream, made to wait on the mark: it outlives any caller's stream */
    void *own = NULL;
    if (raise_status(ragvit_memory_stream(self->device_id, self->mark, &own))) {
        Py_DECREF(dict);
        return NULL;
    }
    PyObject *stream = PyLong_FromVoidPtr(own);
    if (stream == NULL || PyDict_SetItemString(dict, "stream", stream) < 0) {
        Py_XDECREF(stream);
        Py_DECREF(dict);
        return NULL;
    }
    Py_DECREF(stream);
    return dict;
}

PyObject *buffer_get_cai(PyObject *obj, void *unused) {
    (void)unused;
    return buffer_interface((const buffer_object *)obj, 1, "__cuda_array_interface__");
}

PyObject *buffer_get_array_interface(PyObject *obj, void *unused) {
    (void)unused;
    return buffer_interface((const buffer_object *)obj, 0, "__array_interface__");
}

PyObject *buffer_repr(PyObject *obj) {
    const buffer_object *self = (const buffer_object *)obj;
    PyObject *shape = buffer_shape_tuple(self);
    if (shape == NULL) return NULL;
    PyObject *repr =
        self->device_type == RAGVIT_DEVICE_CUDA
            ? PyUnicode_FromFormat("ragvit.Buffer(shape=%R, dtype=%s, device=cuda:%d)", shape,
                                   buffer_dtypes[self->dtype].name, (int)self->device_id)
            : PyUnicode_FromFormat("ragvit.Buffer(shape=%R, dtype=%s, device=cpu)", shape,
                                   buffer_dtypes[self->dtype].name);
    Py_DECREF(shape);
    return repr;
}
