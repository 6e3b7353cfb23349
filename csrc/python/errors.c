/* errors.c — the one place a failing ragvit_status becomes a Python exception.
 * The core (or the glue, through ragvit_fail) has already formatted
 * "<op>: <arg> must be <rule>, got <actual>" into thread-local storage; this
 * picks the exception type from the status and raises that message.
 * Decision: the success test stays inline in glue.h (raise_status), so the hot
 * path pays one compare per status and only a failure calls into this file. */
#include "glue.h"

int raise_failure(ragvit_status status) {
    PyObject *type = PyExc_RuntimeError;
    switch (status) {
    case RAGVIT_STATUS_INVALID_SHAPE:
    case RAGVIT_STATUS_INVALID_VALUE:
    case RAGVIT_STATUS_INVALID_DEVICE:
    case RAGVIT_STATUS_READ_ONLY:
    case RAGVIT_STATUS_DEVICE_ASSERT: type = PyExc_ValueError; break;
    case RAGVIT_STATUS_INVALID_DTYPE:
    case RAGVIT_STATUS_INVALID_TYPE: type = PyExc_TypeError; break;
    case RAGVIT_STATUS_NOT_IMPORTABLE: type = PyExc_BufferError; break;
    case RAGVIT_STATUS_OUT_OF_MEMORY: type = PyExc_MemoryError; break;
    default: type = PyExc_RuntimeError; break;
    }
    const char *message = ragvit_error_message();
    PyErr_SetString(type, message[0] ? message : ragvit_status_string(status));
    return -1;
}
