/* args.c — METH_FASTCALL | METH_KEYWORDS parsing for the op wrappers: the
 * signature (positional, keyword, required, None as absent), stream=, and the
 * scalar arguments (max_seqlen, floats, counts; ints through __index__). Every
 * function returns 0, or -1 with an exception whose message names the op and
 * the argument.
 * Decision: None is the same as leaving an argument out, for every argument, so
 * a Python caller can forward its own None defaults unchanged. */
#include "glue.h"

/* None becomes NULL as each value is stored, so the required check reads only
 * the first `required` values. */
int parse_args(const op_signature *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               PyObject **values) {
    const char *const *names = sig->names;
    if (nargs > sig->max_positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     sig->op, sig->max_positional, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) values[i] = args[i] == Py_None ? NULL : args[i];
    for (Py_ssize_t i = nargs; i < sig->count; i++) values[i] = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j); /* borrowed */
        const int found = keyword_index(key, names, sig->count);
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", sig->op,
                         key);
            return -1;
        }
        if (found < nargs) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", sig->op,
                         names[found]);
            return -1;
        }
        PyObject *value = args[nargs + j]; /* borrowed */
        values[found] = value == Py_None ? NULL : value;
    }
    for (int i = 0; i < sig->required; i++) {
        if (values[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", sig->op, names[i]);
            return -1;
        }
    }
    return 0;
}

/* stream=: an int cudaStream_t handle (0: legacy default) or an object with
 * __cuda_stream__() -> (version, handle). */
int parse_stream(call_state *cs, PyObject *obj) {
    PyObject *pair = NULL, *handle = NULL;
    int rc = -1;
    if (obj == NULL) return 0;
    if (PyLong_Check(obj)) {
        handle = obj;
        Py_INCREF(handle);
    } else {
        PyObject *method = NULL;
        if (lookup_optional(obj, cs->st->str_cuda_stream, &method) < 0) goto done;
        if (method == NULL) {
            raise_failure(
                ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                            "%s: stream must be an int handle or have __cuda_stream__, got %s",
                            cs->op, Py_TYPE(obj)->tp_name));
            goto done;
        }
        pair = PyObject_CallNoArgs(method);
        Py_DECREF(method);
        if (pair == NULL) goto done;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            raise_failure(
                ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                            "%s: stream.__cuda_stream__() must return (version, handle), got %s",
                            cs->op, Py_TYPE(pair)->tp_name));
            goto done;
        }
        handle = PyTuple_GET_ITEM(pair, 1); /* borrowed from pair */
        Py_INCREF(handle);
    }
    cs->stream = PyLong_AsVoidPtr(handle);
    if (cs->stream == NULL && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) { /* name the op and the argument */
            PyErr_Clear();
            raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                                      "%s: stream must be a handle in [-2**63, 2**64), got an "
                                      "int outside it",
                                      cs->op));
        }
        goto done;
    }
    cs->is_stream_resolved = 1;
    rc = 0;
done:
    Py_XDECREF(pair);
    Py_XDECREF(handle);
    return rc;
}

/* obj as a new int reference: itself, or its __index__ (NumPy integers, 0-d
 * integer arrays); NULL with TypeError naming `rule` when it has none. */
static PyObject *as_index(call_state *cs, PyObject *obj, const char *name, const char *rule) {
    if (PyLong_Check(obj)) return Py_NewRef(obj);
    if (!PyIndex_Check(obj)) {
        raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE, "%s: %s must be %s, got %s", cs->op,
                                  name, rule, Py_TYPE(obj)->tp_name));
        return NULL;
    }
    return PyNumber_Index(obj); /* a producer's own exception propagates */
}

/* ValueError "<op>: <name> must be in [0, 2**31), got <value>" for an int argument out
 * of range; overflow (PyLong_AsLongLongAndOverflow's) says it lies beyond int64. */
static int raise_not_int31(call_state *cs, const char *name, int overflow, long long value) {
    if (overflow) value = overflow > 0 ? (long long)INT64_MAX : (long long)INT64_MIN;
    return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_VALUE,
                                     "%s: %s must be in [0, 2**31), got %s%lld", cs->op, name,
                                     overflow ? "an int beyond " : "", value));
}

/* max_seqlen: an int (any __index__) or absent (RAGVIT_MAX_SEQLEN_AUTO). Values past
 * int64 (and INT64_MIN, the AUTO marker) are refused here, with the core's message for
 * out-of-range values; the core refuses the others. */
int parse_max_seqlen(call_state *cs, PyObject *const *values, int i, int64_t *max_seqlen) {
    PyObject *obj = values[i]; /* borrowed */
    *max_seqlen = RAGVIT_MAX_SEQLEN_AUTO;
    if (obj == NULL) return 0;
    PyObject *index = as_index(cs, obj, cs->sig->names[i], "an int or None");
    if (index == NULL) return -1;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (overflow || value == RAGVIT_MAX_SEQLEN_AUTO) {
        return raise_not_int31(cs, cs->sig->names[i], overflow, value);
    }
    *max_seqlen = value;
    return 0;
}

/* Whether obj is a numbers.Real (NumPy's floating and integer scalars register as
 * one): 1 or 0, -1 with an exception set. */
static int is_numbers_real(PyObject *obj) {
    PyObject *numbers = PyImport_ImportModule("numbers"); /* from sys.modules after once */
    if (numbers == NULL) return -1;
    PyObject *real = PyObject_GetAttrString(numbers, "Real");
    Py_DECREF(numbers);
    if (real == NULL) return -1;
    const int is_real = PyObject_IsInstance(obj, real);
    Py_DECREF(real);
    return is_real;
}

/* A real number: a float, an int or any numbers.Real (NumPy's float32); bool refused,
 * as in parse_count, and so are arrays and tensors (a 0-d CUDA tensor would sync).
 * Absent: fallback. */
int parse_float(call_state *cs, PyObject *const *values, int i, double fallback, double *value) {
    PyObject *obj = values[i]; /* borrowed */
    *value = fallback;
    if (obj == NULL) return 0;
    int is_real = 0;
    if (!PyBool_Check(obj)) {
        is_real = PyFloat_Check(obj) || PyLong_Check(obj) ? 1 : is_numbers_real(obj);
        if (is_real < 0) return -1;
    }
    if (!is_real) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                                         "%s: %s must be a float, got %s", cs->op,
                                         cs->sig->names[i], Py_TYPE(obj)->tp_name));
    }
    *value = PyFloat_AsDouble(obj);
    return (*value == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* An int (any __index__) in [0, 2**31); absent: 0 (bool refused: it is almost
 * always a mistake here; NumPy's bool has no __index__). */
int parse_count(call_state *cs, PyObject *const *values, int i, long long *value) {
    PyObject *obj = values[i]; /* borrowed */
    const char *name = cs->sig->names[i];
    *value = 0;
    if (obj == NULL) return 0;
    if (PyBool_Check(obj)) {
        return raise_failure(ragvit_fail(RAGVIT_STATUS_INVALID_TYPE,
                                         "%s: %s must be an int, got %s", cs->op, name,
                                         Py_TYPE(obj)->tp_name));
    }
    PyObject *index = as_index(cs, obj, name, "an int");
    if (index == NULL) return -1;
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (*value == -1 && PyErr_Occurred()) return -1;
    if (overflow || *value < 0 || *value > INT32_MAX) {
        return raise_not_int31(cs, name, overflow, *value);
    }
    return 0;
}
