/* bind_runtime.c — ragvit._C's functions about the build and the process
 * rather than an op: build_info, cuda_is_compiled, cuda_device_count,
 * set_debug/is_debug (the module state's debug flag), _launch_empty, the
 * benchmarks' floor, _memory_stats, the counters of the marks' event pool, and
 * _cupy_ndarray and _cupy_current_stream, the tests' view of the CuPy hand-off.
 * Decision: _launch_empty parses by hand instead of through an op_signature:
 * it must accept any further arguments, so it can be called with exactly the
 * call shape of the op it is compared with. */
#include "glue.h"

PyObject *py_cuda_is_compiled(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyBool_FromLong(ragvit_cuda_is_compiled());
}

/* What setup.py compiled in (RAGVIT_BUILD_* macros; a build without them, e.g.
 * by hand, reports an unknown commit). */
#ifndef RAGVIT_BUILD_COMMIT
#define RAGVIT_BUILD_COMMIT "unknown"
#endif
#ifndef RAGVIT_BUILD_CUDA_ARCHS
#define RAGVIT_BUILD_CUDA_ARCHS ""
#endif
#ifndef RAGVIT_BUILD_CUBLASLT
#define RAGVIT_BUILD_CUBLASLT 0
#endif

PyObject *py_build_info(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *archs = PyUnicode_FromString(RAGVIT_BUILD_CUDA_ARCHS), *list = NULL;
    if (archs == NULL) return NULL;
    if (PyUnicode_GET_LENGTH(archs) == 0) {
        list = PyList_New(0);
    } else {
        PyObject *sep = PyUnicode_FromString(";");
        list = sep ? PyUnicode_Split(archs, sep, -1) : NULL;
        Py_XDECREF(sep);
    }
    Py_DECREF(archs);
    if (list == NULL) return NULL;
    const int cuda = ragvit_cuda_is_compiled();
    return Py_BuildValue("{s:s,s:O,s:N,s:O}", "commit", RAGVIT_BUILD_COMMIT, "cuda",
                         cuda ? Py_True : Py_False, "cuda_archs", list, "cublaslt",
                         (cuda && RAGVIT_BUILD_CUBLASLT) ? Py_True : Py_False);
}

PyObject *py_cuda_device_count(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    int32_t count = 0;
    if (raise_status(ragvit_device_count(&count))) return NULL;
    return PyLong_FromLong(count);
}

PyObject *py_set_debug(PyObject *module, PyObject *flag) {
    int value = PyObject_IsTrue(flag);
    if (value < 0) return NULL;
    ((module_state *)PyModule_GetState(module))->ctx.is_debug = value;
    Py_RETURN_NONE;
}

PyObject *py_is_debug(PyObject *module, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(((module_state *)PyModule_GetState(module))->ctx.is_debug);
}

/* _launch_empty(device=0, stream=0, *args, **kwargs): arguments past device
 * and stream, positional or keyword, are accepted and ignored (same argument
 * count, same keyword names as the op it is compared with). */
PyObject *py_launch_empty(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    PyObject *device_obj = nargs > 0 ? args[0] : NULL; /* borrowed */
    PyObject *stream_obj = nargs > 1 ? args[1] : NULL; /* borrowed */
    static const char *const names[] = {"device", "stream"};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j); /* borrowed */
        const int index = keyword_index(key, names, 2);
        if (index < 0) continue;
        if (index < nargs) {
            PyErr_Format(PyExc_TypeError, "launch_empty() got multiple values for argument '%U'",
                         key);
            return NULL;
        }
        *(index == 0 ? &device_obj : &stream_obj) = args[nargs + j];
    }
    call_state cs;
    call_init(&cs, module, "launch_empty");
    long device = (device_obj && device_obj != Py_None) ? PyLong_AsLong(device_obj) : 0;
    if (device == -1 && PyErr_Occurred()) return NULL;
    if (parse_stream(&cs, stream_obj == Py_None ? NULL : stream_obj)) return NULL;
    if (raise_status(ragvit_launch_empty(&cs.st->ctx, (int32_t)device, cs.stream))) return NULL;
    Py_RETURN_NONE;
}

/* _memory_stats(device=0): the counters of a device's memory (the tests' view of the event
 * pool and the kept blocks): {"events": events created, "marks": marks recorded, "reused": kept
 * blocks reused}, all for the process so far. */
PyObject *py_memory_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "_memory_stats() takes at most 1 argument, got %zd", nargs);
        return NULL;
    }
    const long device = nargs == 1 ? PyLong_AsLong(args[0]) : 0;
    if (device == -1 && PyErr_Occurred()) return NULL;
    int64_t events = 0, marks = 0, reused = 0;
    if (raise_status(ragvit_memory_stats((int32_t)device, &events, &marks, &reused))) return NULL;
    return Py_BuildValue("{s:L,s:L,s:L}", "events", (long long)events, "marks", (long long)marks,
                         "reused", (long long)reused);
}

/* _cupy_ndarray(buffer, like): the cupy.ndarray that a call whose first array argument is
 * like would return for buffer (host buffers too, so a stand-in CuPy can check the
 * construction without a GPU), or None where that route does not apply. */
PyObject *py_cupy_ndarray(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_cupy_ndarray() takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    return cupy_ndarray_like((module_state *)PyModule_GetState(module), args[1], args[0]);
}

/* _cupy_current_stream(device): CuPy's current stream on device as ragvit reads it for the
 * hand-off (None before an output went to a cupy.ndarray). */
PyObject *py_cupy_current_stream(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "_cupy_current_stream() takes 1 argument, got %zd", nargs);
        return NULL;
    }
    const long device = PyLong_AsLong(args[0]);
    if (device == -1 && PyErr_Occurred()) return NULL;
    return cupy_current_stream_of((module_state *)PyModule_GetState(module), (int32_t)device);
}
