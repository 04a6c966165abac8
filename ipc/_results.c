/* scratchd.ipc._results: a collected batch's Completions built in C, one call per batch.
 *
 * The main process turns every finished descriptor that ``_native.Core.collect`` hands back
 * (its FinishedRow tuples) into a ``records.Completion`` holding a ``records.Result`` read
 * from the descriptor's result row. ``ipc/main_side.py``'s ``_completion_of`` and
 * ``records.read_result`` are the definition; this builds the same objects without a Python
 * frame per request. A result with a mask is the one case handed back to Python
 * (``read_result``, passed in by the caller): unpacking bits into a numpy array is numpy's.
 *
 *   Reader(offsets, kit)
 *       offsets: ``layout.result_offsets()`` (the result row's stride and field offsets,
 *       each field's dtype checked there against the C type read here);
 *       kit: (Completion, Result, Handle, statuses, timeout_status, error_status,
 *       timeout_reason), where statuses is the tuple of Status members by code.
 *   Reader.completions(buf, rows, histogram, read_result) -> list[Completion]
 *       buf: the mapped segment (its buffer is held for the call only, so the segment can
 *       be unmapped between calls); rows: FinishedRows, abandoned ones skipped; histogram:
 *       the result table's (slots, 64) uint32 column, whose row ``i`` is copied into each
 *       Result; read_result(i, height, width): the Python definition, for masked results.
 *
 * Nothing here trusts the segment's bytes: a box or error count beyond its field is cut to
 * the field (as numpy's slicing in read_result does), a status code outside Status raises
 * IndexError (as read_result's tuple lookup does), a row naming a descriptor outside the
 * table raises IndexError, and a buffer shorter than the result table raises ValueError,
 * before anything is read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layout_fields.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { DONE = 4, EXPIRED = 5 };
#define ROW_FIELDS 15 /* FinishedRow, _native.c's finished_tuple */
#define RESULT_ARGS 10
#define COMPLETION_ARGS 12

typedef struct {
    PyObject_HEAD
    Py_ssize_t table, stride, slots, max_boxes, error_bytes;
    Py_ssize_t status, verdict, has_mask, n_boxes, error_len, batch_size, score, entropy,
        compute_ns, boxes, error;
    PyObject *completion, *result, *handle, *statuses, *timeout, *error_status, *reason;
} Reader;

#define M(name) offsetof(Reader, name)
static const Field FIELDS[] = {
    {"r.status", 1, M(status)},         {"r.verdict", 1, M(verdict)},
    {"r.has_mask", 1, M(has_mask)},     {"r.n_boxes", 2, M(n_boxes)},
    {"r.error_len", 2, M(error_len)},   {"r.batch_size", 4, M(batch_size)},
    {"r.score", 4, M(score)},           {"r.entropy", 4, M(entropy)},
    {"r.compute_ns", 8, M(compute_ns)}, {"r.boxes", 4, M(boxes)},
    {"r.error", 1, M(error)},
};

static int get(PyObject *offsets, const char *key, Py_ssize_t lo, Py_ssize_t *out) {
    return layout_offset(offsets, "result layout", key, lo, out);
}

static int Reader_init(Reader *self, PyObject *args, PyObject *kw) {
    PyObject *offsets, *kit;
    static char *names[] = {"offsets", "kit", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!", names, &PyDict_Type, &offsets,
                                     &PyTuple_Type, &kit))
        return -1;
    if (self->completion) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is already initialised");
        return -1;
    }
    if (get(offsets, "result_off", 0, &self->table) < 0 ||
        get(offsets, "result_stride", 1, &self->stride) < 0 ||
        get(offsets, "slots", 1, &self->slots) < 0 ||
        get(offsets, "max_boxes", 0, &self->max_boxes) < 0 ||
        get(offsets, "error_bytes", 0, &self->error_bytes) < 0)
        return -1;
    if (self->slots > INT32_MAX || self->stride > PY_SSIZE_T_MAX / self->slots) {
        PyErr_SetString(PyExc_ValueError, "result layout: table too large");
        return -1;
    }
    for (size_t k = 0; k < COUNT(FIELDS); k++) {
        Py_ssize_t off, *at = (Py_ssize_t *)((char *)self + FIELDS[k].member);
        if (get(offsets, FIELDS[k].key, 0, &off) < 0) return -1;
        Py_ssize_t items = at == &self->boxes ? 5 * self->max_boxes
                           : at == &self->error ? self->error_bytes
                                                : 1;
        if (off % FIELDS[k].size || off + items * FIELDS[k].size > self->stride) {
            PyErr_Format(PyExc_ValueError, "result layout: %s at %zd does not fit", FIELDS[k].key,
                         off);
            return -1;
        }
        *at = off;
    }
    PyObject *completion, *result, *handle, *statuses, *timeout, *error_status, *reason;
    if (!PyArg_ParseTuple(kit, "OOO!O!OOU", &completion, &result, &PyType_Type, &handle,
                          &PyTuple_Type, &statuses, &timeout, &error_status, &reason))
        return -1;
    if (!handle_type_ok(handle)) return -1;
    if (!PyCallable_Check(completion) || !PyCallable_Check(result)) {
        PyErr_SetString(PyExc_TypeError, "Completion and Result must be callable");
        return -1;
    }
    self->completion = Py_NewRef(completion), self->result = Py_NewRef(result);
    self->handle = Py_NewRef(handle), self->statuses = Py_NewRef(statuses);
    self->timeout = Py_NewRef(timeout), self->error_status = Py_NewRef(error_status);
    self->reason = Py_NewRef(reason);
    return 0;
}

static void Reader_dealloc(Reader *self) {
    Py_XDECREF(self->completion);
    Py_XDECREF(self->result);
    Py_XDECREF(self->handle);
    Py_XDECREF(self->statuses);
    Py_XDECREF(self->timeout);
    Py_XDECREF(self->error_status);
    Py_XDECREF(self->reason);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define AT(row, T, f) (*(const T *)((row) + self->f))

static PyObject *boxes_of(Reader *self, const char *row) {
    Py_ssize_t n = AT(row, uint16_t, n_boxes);
    if (n > self->max_boxes) n = self->max_boxes;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t b = 0; out && b < n; b++) {
        PyObject *box = PyTuple_New(5);
        if (!box) return Py_DECREF(out), NULL;
        PyList_SET_ITEM(out, b, box);
        for (int k = 0; k < 5; k++) {
            float v;
            memcpy(&v, row + self->boxes + (5 * b + k) * 4, 4);
            PyObject *f = PyFloat_FromDouble((double)v);
            if (!f) return Py_DECREF(out), NULL;
            PyTuple_SET_ITEM(box, k, f);
        }
    }
    return out;
}

/* The Result of descriptor i's row (no mask: the caller handles has_mask). */
static PyObject *result_of(Reader *self, const char *row, PyObject *histogram, long i) {
    uint8_t code = AT(row, uint8_t, status);
    if (code >= PyTuple_GET_SIZE(self->statuses))
        return PyErr_Format(PyExc_IndexError, "result status %d of descriptor %ld unknown",
                            (int)code, i);
    Py_ssize_t n_error = AT(row, uint16_t, error_len);
    if (n_error > self->error_bytes) n_error = self->error_bytes;
    float score, entropy;
    memcpy(&score, row + self->score, 4);
    memcpy(&entropy, row + self->entropy, 4);
    PyObject *a[RESULT_ARGS] = {NULL};
    PyObject *out = NULL, *index = PyLong_FromLong(i), *view = NULL;
    if (!index) return NULL;
    a[0] = Py_NewRef(PyTuple_GET_ITEM(self->statuses, code));
    a[1] = PyBool_FromLong(AT(row, uint8_t, verdict));
    a[2] = PyFloat_FromDouble((double)score);
    a[3] = boxes_of(self, row);
    a[4] = PyFloat_FromDouble((double)entropy);
    view = PyObject_GetItem(histogram, index);
    a[5] = view ? PyObject_CallMethod(view, "copy", NULL) : NULL;
    a[6] = PyLong_FromLongLong(AT(row, int64_t, compute_ns));
    a[7] = PyLong_FromUnsignedLong(AT(row, uint32_t, batch_size));
    a[8] = PyUnicode_DecodeUTF8(row + self->error, n_error, "replace");
    a[9] = Py_NewRef(Py_None);
    int ok = 1;
    for (int k = 0; k < RESULT_ARGS; k++) ok = ok && a[k];
    if (ok) out = PyObject_Vectorcall(self->result, a, RESULT_ARGS, NULL);
    for (int k = 0; k < RESULT_ARGS; k++) Py_XDECREF(a[k]);
    Py_XDECREF(view);
    Py_DECREF(index);
    return out;
}

/* The Completion of one FinishedRow: (index, generation, state, abandoned, request_id,
 * conn_id, enqueue_ns, part_class, height, width, priority, kills, claim_ns, done_ns,
 * worker), as main_side._completion_of builds it. */
static PyObject *completion_of(Reader *self, const char *base, PyObject *t, PyObject *histogram,
                               PyObject *read_result) {
    PyObject **f = &PyTuple_GET_ITEM(t, 0);
    long i = PyLong_AsLong(f[0]), state = PyLong_AsLong(f[2]);
    if (PyErr_Occurred()) return NULL;
    if (i < 0 || i >= self->slots)
        return PyErr_Format(PyExc_IndexError, "descriptor %ld outside the result table", i);
    PyObject *result = Py_None, *status, *error;
    if (state == DONE) {
        const char *row = base + self->table + i * self->stride;
        result = AT(row, uint8_t, has_mask) ? PyObject_CallFunctionObjArgs(read_result, f[0], f[8],
                                                                           f[9], NULL)
                                            : result_of(self, row, histogram, i);
        if (!result) return NULL;
        status = PyObject_GetAttrString(result, "status");
        error = PyUnicode_FromStringAndSize("", 0);
    } else if (state == EXPIRED) {
        Py_INCREF(result);
        status = Py_NewRef(self->timeout);
        error = Py_NewRef(self->reason);
    } else {
        Py_INCREF(result);
        status = Py_NewRef(self->error_status);
        error = PyUnicode_FromFormat(
            "quarantined: %S workers died while processing this request", f[11]);
    }
    PyObject *handle = new_handle((PyTypeObject *)self->handle, Py_NewRef(f[0]), Py_NewRef(f[1]));
    PyObject *out = NULL;
    if (handle && status && error) {
        PyObject *a[COMPLETION_ARGS] = {handle, f[4],  f[5],  f[7],  f[10], status,
                                        result, f[6],  f[12], f[13], f[14], error};
        out = PyObject_Vectorcall(self->completion, a, COMPLETION_ARGS, NULL);
    }
    Py_XDECREF(handle);
    Py_XDECREF(status);
    Py_XDECREF(error);
    Py_DECREF(result);
    return out;
}

static PyObject *Reader_completions(Reader *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "completions takes 4 arguments");
    PyObject *rows = args[1], *histogram = args[2], *read_result = args[3];
    if (!self->completion) return PyErr_Format(PyExc_ValueError, "Reader not initialised");
    if (!PyList_Check(rows)) return PyErr_Format(PyExc_TypeError, "rows must be a list");
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (view.len < self->table || view.len - self->table < self->slots * self->stride) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is shorter than the result table",
                     view.len);
        goto done;
    }
    if (!(out = PyList_New(0))) goto done;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(rows); k++) {
        PyObject *t = PyList_GET_ITEM(rows, k);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != ROW_FIELDS) {
            PyErr_Format(PyExc_TypeError, "row %zd is not a %d-tuple", k, ROW_FIELDS);
            goto fail;
        }
        int abandoned = PyObject_IsTrue(PyTuple_GET_ITEM(t, 3));
        if (abandoned < 0) goto fail;
        if (abandoned) continue; /* its client left: freed without a Completion */
        PyObject *c = completion_of(self, view.buf, t, histogram, read_result);
        if (!c || PyList_Append(out, c) < 0) {
            Py_XDECREF(c);
            goto fail;
        }
        Py_DECREF(c);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef Reader_methods[] = {
    {"completions", (PyCFunction)(void (*)(void))Reader_completions, METH_FASTCALL,
     "completions(buf, rows, histogram, read_result): the batch's Completions"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "scratchd.ipc._results.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Completions of collected FinishedRows, built from the result table",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "scratchd.ipc._results",
    .m_doc = "A collected batch's Completions built in C (see ipc/main_side.py)", .m_size = -1,
};

PyMODINIT_FUNC PyInit__results(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
