/* module.c — ragvit._C's lifecycle: the method table, the PyModuleDef with
 * multi-phase init (Py_mod_exec), and the module state (core context, exchange
 * API cache, the array-namespace cache, the ragvit.Buffer type, torch's is_neg
 * and _increment_version once a torch tensor was seen, CuPy's constructors once an
 * output went to a cupy.ndarray, interned attribute names)
 * with its traverse/clear/free.
 * Layout of the glue: errors.c raises, args.c parses, interop.c imports and
 * allocates, buffer.c holds ragvit.Buffer, bind_<family>.c wrap the ops, docs.h
 * holds every docstring.
 * Decision: everything a call needs lives in the module state, not in C
 * globals, so each (sub)interpreter's module owns its own cache and context. */
#include "glue.h"

#include <structmember.h>

#include "docs.h"

#define FASTCALL_METHOD(name)                                                                      \
    {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL | METH_KEYWORDS, name##_doc}

static PyMethodDef module_methods[] = {
    FASTCALL_METHOD(attention),
    FASTCALL_METHOD(pack),
    FASTCALL_METHOD(pack_into),
    FASTCALL_METHOD(unpack),
    FASTCALL_METHOD(repack),
    FASTCALL_METHOD(repack_into),
    FASTCALL_METHOD(gather_prefix),
    FASTCALL_METHOD(segment_mean),
    FASTCALL_METHOD(linear),
    FASTCALL_METHOD(layer_norm),
    FASTCALL_METHOD(gelu),
    FASTCALL_METHOD(topk_index),
    FASTCALL_METHOD(graph_replay),
    {"build_info", py_build_info, METH_NOARGS, build_info_doc},
    {"cuda_is_compiled", py_cuda_is_compiled, METH_NOARGS, cuda_is_compiled_doc},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, cuda_device_count_doc},
    {"set_debug", py_set_debug, METH_O, set_debug_doc},
    {"is_debug", py_is_debug, METH_NOARGS, is_debug_doc},
    {"_launch_empty", (PyCFunction)(void (*)(void))py_launch_empty, METH_FASTCALL | METH_KEYWORDS,
     launch_empty_doc},
    {"_memory_stats", (PyCFunction)(void (*)(void))py_memory_stats, METH_FASTCALL,
     memory_stats_doc},
    {"_cupy_ndarray", (PyCFunction)(void (*)(void))py_cupy_ndarray, METH_FASTCALL,
     cupy_ndarray_doc},
    {"_cupy_current_stream", (PyCFunction)(void (*)(void))py_cupy_current_stream, METH_FASTCALL,
     cupy_current_stream_doc},
    {NULL, NULL, 0, NULL},
};

/* ---- ragvit.Buffer (buffer.c) ---- */

static PyMethodDef buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_FASTCALL | METH_KEYWORDS,
     buffer_dlpack_doc},
    {"__dlpack_device__", buffer_dlpack_device, METH_NOARGS, buffer_dlpack_device_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef buffer_getset[] = {
    {"shape", buffer_get_shape, NULL, "The shape, a tuple of ints.", NULL},
    {"ndim", buffer_get_ndim, NULL, "The number of dimensions.", NULL},
    {"dtype", buffer_get_dtype, NULL, "The element type's name, e.g. 'float32'.", NULL},
    {"__cuda_array_interface__", buffer_get_cai, NULL, buffer_cai_doc, NULL},
    {"__array_interface__", buffer_get_array_interface, NULL, buffer_array_interface_doc, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef buffer_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(buffer_object, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, (void *)buffer_dealloc},
    {Py_tp_repr, (void *)buffer_repr},
    {Py_tp_methods, buffer_methods},
    {Py_tp_getset, buffer_getset},
    {Py_tp_members, buffer_members},
    {Py_tp_doc, (void *)buffer_doc},
    {0, NULL},
};

/* Instances are made by the ops only (no constructor); the type is immutable. */
static PyType_Spec buffer_spec = {
    .name = "ragvit.Buffer",
    .basicsize = sizeof(buffer_object),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = buffer_slots,
};

static int module_exec(PyObject *module) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (import_numpy_api() < 0) return -1;
    ragvit_context_init(&st->ctx);
    const char *debug = getenv("RAGVIT_DEBUG");
    st->ctx.is_debug = debug && debug[0] && strcmp(debug, "0") != 0;
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->str_cai = PyUnicode_InternFromString("__cuda_array_interface__");
    st->str_requires_grad = PyUnicode_InternFromString("requires_grad");
    st->str_cuda_stream = PyUnicode_InternFromString("__cuda_stream__");
    st->str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->str_stream = PyUnicode_InternFromString("stream");
    st->str_max_version = PyUnicode_InternFromString("max_version");
    st->str_array_namespace = PyUnicode_InternFromString("__array_namespace__");
    st->str_from_dlpack = PyUnicode_InternFromString("from_dlpack");
    st->max_version = Py_BuildValue("(ii)", 1, 0);
    if (!st->str_dlpack || !st->str_dlpack_device || !st->str_cai || !st->str_requires_grad ||
        !st->str_cuda_stream || !st->str_exchange_api || !st->str_stream || !st->str_max_version ||
        !st->str_array_namespace || !st->str_from_dlpack || !st->max_version) {
        return -1;
    }
    st->buffer_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &buffer_spec, NULL);
    if (st->buffer_type == NULL ||
        PyModule_AddObjectRef(module, "Buffer", (PyObject *)st->buffer_type) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "TOPK_INDEX_MAX_COLS", RAGVIT_TOPK_MAX_COLS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_DIMS", RAGVIT_MAX_DIMS) < 0 ||
        PyModule_AddIntConstant(module, "GRAPH_MAX_OUTPUTS", RAGVIT_GRAPH_MAX_OUTPUTS) < 0) {
        return -1;
    }
    return PyModule_AddStringConstant(module, "dlpack_version", "1.3");
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_count; i++) Py_VISIT(st->api_cache[i].type);
    for (int i = 0; i < NAMESPACE_CACHE_SIZE; i++) {
        Py_VISIT(st->namespace_cache[i].type_ref);
        Py_VISIT(st->namespace_cache[i].from_dlpack);
    }
    Py_VISIT(st->buffer_type);
    Py_VISIT(st->torch_is_neg);
    Py_VISIT(st->torch_increment_version);
    Py_VISIT(st->torch_is_grad_enabled);
    return cupy_state_traverse(&st->cupy, visit, arg);
}

static int module_clear(PyObject *module) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_count; i++) Py_CLEAR(st->api_cache[i].type);
    st->api_cache_count = 0;
    for (int i = 0; i < NAMESPACE_CACHE_SIZE; i++) {
        st->namespace_cache[i].type = NULL;
        Py_CLEAR(st->namespace_cache[i].type_ref);
        Py_CLEAR(st->namespace_cache[i].from_dlpack);
    }
    Py_CLEAR(st->buffer_type);
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_dlpack_device);
    Py_CLEAR(st->str_cai);
    Py_CLEAR(st->str_requires_grad);
    Py_CLEAR(st->str_cuda_stream);
    Py_CLEAR(st->str_exchange_api);
    Py_CLEAR(st->str_stream);
    Py_CLEAR(st->str_max_version);
    Py_CLEAR(st->str_array_namespace);
    Py_CLEAR(st->str_from_dlpack);
    Py_CLEAR(st->max_version);
    Py_CLEAR(st->torch_is_neg);
    Py_CLEAR(st->torch_increment_version);
    Py_CLEAR(st->torch_is_grad_enabled);
    st->is_grad_enabled_c = NULL;
    cupy_state_clear(&st->cupy);
    return 0;
}

static void module_free(void *module) {
    module_state *st = (module_state *)PyModule_GetState((PyObject *)module);
    module_clear((PyObject *)module);
    if (st) ragvit_context_release(&st->ctx);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,          .m_name = "ragvit._C",       .m_doc = module_doc,
    .m_size = sizeof(module_state), .m_methods = module_methods, .m_slots = module_slots,
    .m_traverse = module_traverse,  .m_clear = module_clear,     .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
