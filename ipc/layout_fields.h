/* Binding a C extension to the shared-memory layout ipc/layout.py computes (shared by
 * _native.c and _results.c): a field table's row type, the lookup of one offset in the
 * layout's offsets dict, and records.Handle, the (index, generation) pair both build.
 * Include after <Python.h>. */
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

/* Whether `type` may be built as a Handle is: a tuple subclass that adds nothing to a
 * tuple's layout (a NamedTuple), so that tp_alloc with two items and the items set is a whole
 * instance, as tuple_new builds a subclass's (no Python __new__ run). TypeError if not. */
static inline int handle_type_ok(PyObject *type) {
    PyTypeObject *t = (PyTypeObject *)type;
    if (PyType_Check(type) && PyType_IsSubtype(t, &PyTuple_Type) &&
        t->tp_basicsize == PyTuple_Type.tp_basicsize &&
        t->tp_itemsize == PyTuple_Type.tp_itemsize)
        return 1;
    PyErr_SetString(PyExc_TypeError, "handle must be a tuple subclass without added fields");
    return 0;
}

/* type(index, generation), stealing both references (NULL ones too: then NULL); type NULL
 * builds a plain tuple. */
static inline PyObject *new_handle(PyTypeObject *type, PyObject *index, PyObject *generation) {
    PyObject *h = !index || !generation ? NULL
                  : type                ? type->tp_alloc(type, 2)
                                        : PyTuple_New(2);
    if (!h) {
        Py_XDECREF(index);
        Py_XDECREF(generation);
        return NULL;
    }
    PyTuple_SET_ITEM(h, 0, index);
    PyTuple_SET_ITEM(h, 1, generation);
    return h;
}

#endif
