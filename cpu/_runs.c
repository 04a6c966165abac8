/* scratchd.cpu._runs: the GPU path's host finish of one frame, in C.
 *
 * The device (kernels/row_runs.py) leaves each frame's foreground as row-major horizontal
 * runs, one int32 record [row, start, end, sum] a run (end exclusive; sum = the float32
 * bits of the probability summed over the run). finish_records joins them into 8-connected
 * components, drops those under min_area, and returns the boxes of the rest, highest score
 * first; when given a mask it paints the kept components 0/255 into it.
 *
 * It is kernels/postprocess.py's finish_runs (the numpy reference and the CPU path's finish)
 * on the same records, with the same arithmetic, so the two agree exactly
 * (tests/cpu/test__runs.py):
 *
 *   - two runs on adjacent rows touch when start_b <= end_a and end_b >= start_a (8-connected);
 *     a two-pointer sweep over each pair of adjacent rows finds every touching pair;
 *   - union-find whose root is always the smallest run index of its set (the larger root is
 *     linked to the smaller), so components are numbered by their first run, as the
 *     reference's labels are;
 *   - per component, area (pixels) and the run sums added in run order in double (as
 *     np.bincount adds them); score = sum / area; boxes (x0, y0, x1, y1, score) of the
 *     kept components, sorted by score descending, ties by component number (a stable sort
 *     of -score, as np.argsort(kind="stable")).
 *
 * The records are checked first (each run inside the frame, start < end, row-major and
 * disjoint within a row): a ValueError, never a wrong answer or a crash, for records the
 * device did not write as promised. The GIL is released while it computes.
 * It is C because the numpy finish of a one-view frame costs about as much host time as the
 * GPU spends on the frame: in C one worker keeps its GPU busy (docs/benchmarks.md, host finish).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t area;
    double sum, score;
    int32_t x0, y0, x1, y1;
    int32_t id;
} Comp;

static int32_t find(int32_t *parent, int32_t i) {
    while (parent[i] != i) {
        parent[i] = parent[parent[i]]; /* path halving */
        i = parent[i];
    }
    return i;
}

static void join(int32_t *parent, int32_t a, int32_t b) {
    a = find(parent, a);
    b = find(parent, b);
    if (a < b) parent[b] = a;
    else if (b < a) parent[a] = b;
}

/* score descending; ties (and NaNs, which go last) by component number ascending */
static int by_score(const void *pa, const void *pb) {
    const Comp *a = pa, *b = pb;
    int na = isnan(a->score), nb = isnan(b->score);
    if (na != nb) return na - nb;
    if (!na && a->score != b->score) return a->score > b->score ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

/* 0, or a message for the first record that breaks the layout */
static const char *check(const int32_t *r, Py_ssize_t n, int32_t height, int32_t width) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int32_t *q = r + 4 * i;
        if (q[0] < 0 || q[0] >= height || q[1] < 0 || q[1] >= q[2] || q[2] > width)
            return "a run lies outside the frame or is empty";
        if (i > 0) {
            const int32_t *p = q - 4;
            if (q[0] < p[0] || (q[0] == p[0] && q[1] <= p[2]))
                return "runs are not row-major and disjoint within a row";
        }
    }
    return NULL;
}

/* Components of the n runs into comps (kept ones first, sorted); returns how many kept. */
static Py_ssize_t finish(const int32_t *r, Py_ssize_t n, int32_t width, int64_t min_area,
                         int32_t *parent, int32_t *label, Comp *comps, uint8_t *mask) {
    for (Py_ssize_t i = 0; i < n; i++) parent[i] = (int32_t)i;
    Py_ssize_t a0 = 0;
    while (a0 < n) { /* runs a0..a1 on one row, b0..b1 on the row below it */
        int32_t row = r[4 * a0];
        Py_ssize_t a1 = a0;
        while (a1 < n && r[4 * a1] == row) a1++;
        Py_ssize_t b1 = a1;
        while (b1 < n && r[4 * b1] == row + 1) b1++;
        Py_ssize_t j = a1;
        for (Py_ssize_t a = a0; a < a1 && j < b1; a++) {
            int32_t start = r[4 * a + 1], end = r[4 * a + 2];
            while (j < b1 && r[4 * j + 2] < start) j++;
            for (Py_ssize_t k = j; k < b1 && r[4 * k + 1] <= end; k++)
                join(parent, (int32_t)a, (int32_t)k);
        }
        a0 = a1;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int32_t *q = r + 4 * i;
        int32_t root = find(parent, (int32_t)i);
        if (root == i) {
            label[i] = (int32_t)count;
            comps[count] = (Comp){.area = 0, .sum = 0.0, .x0 = q[1], .y0 = q[0], .x1 = q[2],
                                  .y1 = q[0] + 1, .id = (int32_t)count};
            count++;
        } else {
            label[i] = label[root];
        }
        Comp *c = &comps[label[i]];
        float s;
        memcpy(&s, &q[3], sizeof s);
        c->area += q[2] - q[1];
        c->sum += (double)s;
        if (q[1] < c->x0) c->x0 = q[1];
        if (q[2] > c->x1) c->x1 = q[2];
        if (q[0] + 1 > c->y1) c->y1 = q[0] + 1; /* y0 is the first run's row: runs are sorted */
    }
    if (mask) {
        for (Py_ssize_t i = 0; i < n; i++) {
            const int32_t *q = r + 4 * i;
            if (comps[label[i]].area >= min_area)
                memset(mask + (int64_t)q[0] * width + q[1], 255, (size_t)(q[2] - q[1]));
        }
    }
    Py_ssize_t kept = 0;
    for (Py_ssize_t c = 0; c < count; c++) {
        if (comps[c].area < min_area) continue;
        comps[kept] = comps[c];
        comps[kept].score = comps[c].sum / (double)comps[c].area;
        kept++;
    }
    qsort(comps, (size_t)kept, sizeof(Comp), by_score);
    return kept;
}

static const char FINISH_DOC[] =
    "finish_records(records, count, height, width, min_area, mask=None) -> boxes\n\n"
    "The components of a frame's first count run records (int32 [cap, 4], C-contiguous:\n"
    "row, start, end, float32 bits of the run's probability sum; row-major): boxes\n"
    "[(x0, y0, x1, y1, score)] of those with at least min_area pixels, highest score first.\n"
    "mask: a writable C-contiguous uint8 [height, width] array, overwritten with the kept\n"
    "components as 255 on 0. Equal to postprocess.finish_runs on unpack_runs(records, count).";

static PyObject *py_finish_records(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *orec, *omask = Py_None;
    Py_ssize_t count;
    int height, width;
    long long min_area;
    if (!PyArg_ParseTuple(args, "OniiL|O", &orec, &count, &height, &width, &min_area, &omask))
        return NULL;
    if (height < 1 || width < 1)
        return PyErr_Format(PyExc_ValueError, "finish_records: bad frame %dx%d", height, width);
    Py_buffer rec, mk = {0};
    if (PyObject_GetBuffer(orec, &rec, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "finish_records: records must be C-contiguous");
    }
    const char *f = rec.format ? rec.format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    const char *bad = NULL;
    if (rec.itemsize != 4 || (strcmp(f, "i") != 0 && strcmp(f, "l") != 0) || rec.ndim != 2 ||
        rec.shape[1] != 4)
        bad = "records must be int32 [cap, 4]";
    else if (count < 0 || count > rec.shape[0] || count >= INT32_MAX)
        bad = "count is outside 0 .. len(records)";
    if (!bad && omask != Py_None) {
        if (PyObject_GetBuffer(omask, &mk, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            bad = "mask must be a writable C-contiguous array";
        } else if (mk.len != (Py_ssize_t)height * width || mk.itemsize != 1) {
            bad = "mask must be uint8 [height, width]";
        }
    }
    if (!bad) bad = check(rec.buf, count, height, width);
    if (bad) {
        if (mk.obj) PyBuffer_Release(&mk);
        PyBuffer_Release(&rec);
        return PyErr_Format(PyExc_ValueError, "finish_records: %s", bad);
    }
    size_t n = (size_t)count ? (size_t)count : 1;
    int32_t *parent = malloc(n * sizeof(int32_t)), *label = malloc(n * sizeof(int32_t));
    Comp *comps = malloc(n * sizeof(Comp));
    if (!parent || !label || !comps) {
        free(parent);
        free(label);
        free(comps);
        if (mk.obj) PyBuffer_Release(&mk);
        PyBuffer_Release(&rec);
        return PyErr_NoMemory();
    }
    uint8_t *mask = mk.obj ? mk.buf : NULL;
    Py_ssize_t kept;
    Py_BEGIN_ALLOW_THREADS;
    if (mask) memset(mask, 0, (size_t)mk.len);
    kept = finish(rec.buf, count, width, (int64_t)min_area, parent, label, comps, mask);
    Py_END_ALLOW_THREADS;
    PyObject *boxes = PyList_New(kept);
    for (Py_ssize_t i = 0; boxes && i < kept; i++) {
        const Comp *c = &comps[i];
        PyObject *box = Py_BuildValue("(ddddd)", (double)c->x0, (double)c->y0, (double)c->x1,
                                      (double)c->y1, c->score);
        if (!box) Py_CLEAR(boxes);
        else PyList_SET_ITEM(boxes, i, box);
    }
    free(parent);
    free(label);
    free(comps);
    if (mk.obj) PyBuffer_Release(&mk);
    PyBuffer_Release(&rec);
    return boxes;
}

static PyMethodDef methods[] = {
    {"finish_records", py_finish_records, METH_VARARGS, FINISH_DOC},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "scratchd.cpu._runs",
    "The GPU path's host finish of a frame's run records (see cpu/_runs.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__runs(void) { return PyModule_Create(&module); }
