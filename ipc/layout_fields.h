/* Binding a C extension to the shared-memory layout ipc/layout.py computes (shared by
 * _native.c and _results.c): a field table's row type, and the lookup of one offset in the
 * layout's offsets dict. Include after <Python.h>. */
#ifndef SCRATCHD_IPC_LAYOUT_FIELDS_H
#define SCRATCHD_IPC_LAYOUT_FIELDS_H

#include <stddef.h>

typedef struct {
    const char *key;  /* its name in the offsets dict */
    Py_ssize_t size;  /* bytes of the C type the field is read as (sub-arrays: one item) */
    size_t member;    /* offsetof the Py_ssize_t that keeps the field's offset */
} Field;

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* offsets[key] into *out, refused below lo; `what` names the layout in the error. */
static inline int layout_offset(PyObject *offsets, const char *what, const char *key,
                                Py_ssize_t lo, Py_ssize_t *out) {
    PyObject *v = PyDict_GetItemString(offsets, key); /* borrowed */
    if (!v) {
        PyErr_Format(PyExc_KeyError, "%s: %s missing", what, key);
        return -1;
    }
    *out = PyLong_AsSsize_t(v);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (*out < lo) {
        PyErr_Format(PyExc_ValueError, "%s: %s = %zd is below %zd", what, key, *out, lo);
        return -1;
    }
    return 0;
}

#endif
