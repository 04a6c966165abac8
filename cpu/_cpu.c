/* scratchd.cpu._cpu: the CPU schedule's per-band kernels, in one pass over memory.
 *
 * Called by cpu/schedule.py on one band (a run of output rows of one image) at a
 * time, from several Python threads at once: every function checks its arrays (float32,
 * C-contiguous, shapes that agree, output writable and not overlapping an input; a
 * ValueError names the function and the argument), then releases the GIL while it
 * computes and writes only the output band it was given, so bands run truly in parallel.
 * The numpy references in kernels/<op>.py are the definition; tests/cpu/test__cpu.py
 * compares every function here with them. The kernels themselves (layouts, arithmetic
 * order, instruction sets) are in _cpu_kernels.h. Also here: current_cpu / leave_cpu, which
 * cpu/bands.py uses to keep a layer's two bands off one core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h> /* sched_getcpu, sched_{get,set}affinity: _GNU_SOURCE comes with Python.h */
#include <stdlib.h>
#include <string.h>

#include "_cpu_kernels.h"

static const Kernels *K = &kernels_baseline;

/* ---- Python bindings -------------------------------------------------------------------- */

/* A C-contiguous float32 buffer of ndim axes (writable if asked), or -1 with ValueError. */
static int get_f32(PyObject *obj, Py_buffer *v, int writable, int ndim, const char *op,
                   const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a C-contiguous%s float32 array", op,
                     name, writable ? ", writable" : "");
        return -1;
    }
    const char *f = v->format ? v->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (v->itemsize != 4 || strcmp(f, "f") != 0 || v->ndim != ndim) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s must be float32 with %d axes (got format %s, %d axes)", op, name,
                     ndim, v->format ? v->format : "B", v->ndim);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int shape_is(const Py_buffer *v, Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, int nd) {
    return v->shape[0] == a && (nd < 2 || v->shape[1] == b) && (nd < 3 || v->shape[2] == c);
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    const char *pa = a->buf, *pb = b->buf;
    return pa < pb + b->len && pb < pa + a->len;
}

#define BUFS 5
typedef struct {
    Py_buffer v[BUFS];
    int n;
} Held;

static void release(Held *h) {
    for (int i = 0; i < h->n; i++) PyBuffer_Release(&h->v[i]);
    h->n = 0;
}

/* obj as the next buffer h holds; on failure everything h holds is released (ValueError set),
 * so a chain of takes joined by || needs no clean-up of its own. */
static Py_buffer *take(Held *h, PyObject *obj, int writable, int ndim, const char *op,
                       const char *name) {
    if (get_f32(obj, &h->v[h->n], writable, ndim, op, name) < 0) {
        release(h);
        return NULL;
    }
    return &h->v[h->n++];
}

static PyObject *fail(Held *h, const char *op, const char *msg) {
    release(h);
    PyErr_Format(PyExc_ValueError, "%s: %s", op, msg);
    return NULL;
}

static PyObject *no_memory(Held *h) {
    release(h);
    return PyErr_NoMemory();
}

static const char DW_DOC[] =
    "dwconv3x3(x, w, b, y, r0, stride, dilation)\n\n"
    "y[r] = relu(b + depthwise 3x3 of x) for output rows r0 .. r0 + len(y) - 1;\n"
    "x [H, W, C], w [3, 3, C], b [C], y [R, Wo, C] with Wo = (W - 1) // stride + 1.";

static PyObject *py_dwconv3x3(PyObject *self, PyObject *args) {
    (void)self;
    static const char *op = "dwconv3x3";
    PyObject *ox, *ow, *ob, *oy;
    int r0, s, d;
    if (!PyArg_ParseTuple(args, "OOOOiii", &ox, &ow, &ob, &oy, &r0, &s, &d)) return NULL;
    Held h = {.n = 0};
    Py_buffer *x, *w, *b, *y;
    if (!(x = take(&h, ox, 0, 3, op, "x")) || !(w = take(&h, ow, 0, 3, op, "w")) ||
        !(b = take(&h, ob, 0, 1, op, "b")) || !(y = take(&h, oy, 1, 3, op, "y")))
        return NULL;
    Py_ssize_t H = x->shape[0], W = x->shape[1], C = x->shape[2], R = y->shape[0];
    if (s != 1 && s != 2) return fail(&h, op, "stride must be 1 or 2");
    if (d < 1) return fail(&h, op, "dilation must be >= 1");
    Py_ssize_t Ho = (H - 1) / s + 1, Wo = (W - 1) / s + 1;
    if (H < 1 || W < 1 || C < 1) return fail(&h, op, "x must not be empty");
    if (!shape_is(w, 3, 3, C, 3)) return fail(&h, op, "w must have shape [3, 3, C] of x");
    if (!shape_is(b, C, 0, 0, 1)) return fail(&h, op, "b must have shape [C] of x");
    if (!shape_is(y, R, Wo, C, 3)) return fail(&h, op, "y must have shape [R, Wo, C]");
    if (r0 < 0 || r0 + R > Ho) return fail(&h, op, "rows r0 .. r0 + R are not all output rows");
    if (overlaps(y, x) || overlaps(y, w) || overlaps(y, b))
        return fail(&h, op, "y must not overlap an input");
    float *zero = calloc((size_t)(W * C), sizeof(float));
    if (!zero) return no_memory(&h);
    DwRow g = {.x = x->buf, .h = (int)H, .w = (int)W, .c = (int)C, .s = s, .d = d, .px = C,
               .wstep = C, .wt = w->buf, .b = b->buf, .zero = zero, .os = C, .wo = (int)Wo};
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < R; r++) {
        g.out = (float *)y->buf + r * Wo * C;
        K->dw_row(&g, (int)(r0 + r));
    }
    Py_END_ALLOW_THREADS;
    free(zero);
    release(&h);
    Py_RETURN_NONE;
}

/* Phase weights of the upsampled channels: wph[(a, bb, ty, tx)][c] = sum of w[ky, kx, c]
 * over the ky (kx) that land on low-res row (column) tap ty (tx) for output parity a (bb). */
static void phase_weights(const float *w, int cin, int c1, float *wph) {
    static const int first[2][2] = {{0, 1}, {0, 2}}, last[2][2] = {{0, 2}, {1, 2}};
    for (int a = 0; a < 2; a++)
        for (int bb = 0; bb < 2; bb++)
            for (int ty = 0; ty < 2; ty++)
                for (int tx = 0; tx < 2; tx++) {
                    float *o = wph + (ptrdiff_t)(((a * 2 + bb) * 2 + ty) * 2 + tx) * c1;
                    for (int c = 0; c < c1; c++) {
                        float sum = 0.0f;
                        for (int ky = first[a][ty]; ky <= last[a][ty]; ky++)
                            for (int kx = first[bb][tx]; kx <= last[bb][tx]; kx++)
                                sum += w[(ky * 3 + kx) * cin + c];
                        o[c] = sum;
                    }
                }
}

static const char JOIN_DOC[] =
    "dwconv3x3_join(x, skip, w, b, y, r0)\n\n"
    "y[r] = relu(b + depthwise 3x3 (stride 1) of upsample_concat(x, skip)), output rows\n"
    "r0 .. r0 + len(y) - 1, without building the joined tensor; x [h, w, C1],\n"
    "skip [2h, 2w, C2], w [3, 3, C1 + C2], b [C1 + C2], y [R, 2w, C1 + C2].";

static PyObject *py_dwconv3x3_join(PyObject *self, PyObject *args) {
    (void)self;
    static const char *op = "dwconv3x3_join";
    PyObject *ox, *osk, *ow, *ob, *oy;
    int r0;
    if (!PyArg_ParseTuple(args, "OOOOOi", &ox, &osk, &ow, &ob, &oy, &r0)) return NULL;
    Held h = {.n = 0};
    Py_buffer *x, *sk, *w, *b, *y;
    if (!(x = take(&h, ox, 0, 3, op, "x")) || !(sk = take(&h, osk, 0, 3, op, "skip")) ||
        !(w = take(&h, ow, 0, 3, op, "w")) || !(b = take(&h, ob, 0, 1, op, "b")) ||
        !(y = take(&h, oy, 1, 3, op, "y")))
        return NULL;
    Py_ssize_t lh = x->shape[0], lw = x->shape[1], c1 = x->shape[2], c2 = sk->shape[2];
    Py_ssize_t H = 2 * lh, W = 2 * lw, C = c1 + c2, R = y->shape[0];
    if (lh < 1 || lw < 1 || c1 < 1 || c2 < 1) return fail(&h, op, "x and skip must not be empty");
    if (!shape_is(sk, H, W, c2, 3)) return fail(&h, op, "skip must have shape [2h, 2w, C2]");
    if (!shape_is(w, 3, 3, C, 3)) return fail(&h, op, "w must have shape [3, 3, C1 + C2]");
    if (!shape_is(b, C, 0, 0, 1)) return fail(&h, op, "b must have shape [C1 + C2]");
    if (!shape_is(y, R, W, C, 3)) return fail(&h, op, "y must have shape [R, 2w, C1 + C2]");
    if (r0 < 0 || r0 + R > H) return fail(&h, op, "rows r0 .. r0 + R are not all output rows");
    if (overlaps(y, x) || overlaps(y, sk) || overlaps(y, w) || overlaps(y, b))
        return fail(&h, op, "y must not overlap an input");
    Py_ssize_t zn = lw * c1 > W * c2 ? lw * c1 : W * c2;
    float *zero = calloc((size_t)zn, sizeof(float));
    float *wph = malloc((size_t)(16 * c1) * sizeof(float));
    if (!zero || !wph) {
        free(zero);
        free(wph);
        return no_memory(&h);
    }
    const float *wt = w->buf, *bias = b->buf;
    UpRow up = {.x = x->buf, .h = (int)lh, .w = (int)lw, .c1 = (int)c1, .wph = wph, .b = bias,
                .zero = zero, .cy = (int)C};
    DwRow sg = {.x = sk->buf, .h = (int)H, .w = (int)W, .c = (int)c2, .s = 1, .d = 1, .px = c2,
                .wstep = C, .wt = wt + c1, .b = bias + c1, .zero = zero, .os = C, .wo = (int)W};
    Py_BEGIN_ALLOW_THREADS;
    phase_weights(wt, (int)C, (int)c1, wph);
    for (Py_ssize_t r = 0; r < R; r++) {
        float *row = (float *)y->buf + r * W * C;
        up.out = row;
        K->up_row(&up, (int)(r0 + r));
        sg.out = row + c1;
        K->dw_row(&sg, (int)(r0 + r));
    }
    Py_END_ALLOW_THREADS;
    free(zero);
    free(wph);
    release(&h);
    Py_RETURN_NONE;
}

static const char STEM_DOC[] =
    "stem3x3(x, w, b, y, r0)\n\n"
    "y[r] = relu(b + 3x3 convolution of the one-channel x, stride 2, zero padding 1),\n"
    "output rows r0 .. r0 + len(y) - 1; x [H, W], w [9, Cout] (= [3, 3, 1, Cout]),\n"
    "b [Cout], y [R, (W - 1) // 2 + 1, Cout].";

static PyObject *py_stem3x3(PyObject *self, PyObject *args) {
    (void)self;
    static const char *op = "stem3x3";
    PyObject *ox, *ow, *ob, *oy;
    int r0;
    if (!PyArg_ParseTuple(args, "OOOOi", &ox, &ow, &ob, &oy, &r0)) return NULL;
    Held h = {.n = 0};
    Py_buffer *x, *w, *b, *y;
    if (!(x = take(&h, ox, 0, 2, op, "x")) || !(w = take(&h, ow, 0, 2, op, "w")) ||
        !(b = take(&h, ob, 0, 1, op, "b")) || !(y = take(&h, oy, 1, 3, op, "y")))
        return NULL;
    Py_ssize_t H = x->shape[0], W = x->shape[1], cout = w->shape[1], R = y->shape[0];
    Py_ssize_t Ho = (H - 1) / 2 + 1, Wo = (W - 1) / 2 + 1;
    if (H < 1 || W < 1 || cout < 1) return fail(&h, op, "x and w must not be empty");
    if (!shape_is(w, 9, cout, 0, 2)) return fail(&h, op, "w must have shape [9, Cout]");
    if (!shape_is(b, cout, 0, 0, 1)) return fail(&h, op, "b must have shape [Cout]");
    if (!shape_is(y, R, Wo, cout, 3)) return fail(&h, op, "y must have shape [R, Wo, Cout]");
    if (r0 < 0 || r0 + R > Ho) return fail(&h, op, "rows r0 .. r0 + R are not all output rows");
    if (overlaps(y, x) || overlaps(y, w) || overlaps(y, b))
        return fail(&h, op, "y must not overlap an input");
    StemRow g = {.x = x->buf, .h = (int)H, .w = (int)W, .cout = (int)cout, .wt = w->buf,
                 .b = b->buf, .wo = (int)Wo};
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < R; r++) {
        g.out = (float *)y->buf + r * Wo * cout;
        K->stem_row(&g, (int)(r0 + r));
    }
    Py_END_ALLOW_THREADS;
    release(&h);
    Py_RETURN_NONE;
}

static const char BILINEAR_DOC[] =
    "bilinear2x(x, y, r0)\n\n"
    "Rows r0 .. r0 + len(y) - 1 of upsample_bilinear2x_ref(x) cropped to y's width, bit\n"
    "for bit; x [h, w] (one channel), y [R, width] with width <= 2w, r0 + R <= 2h.";

static PyObject *py_bilinear2x(PyObject *self, PyObject *args) {
    (void)self;
    static const char *op = "bilinear2x";
    PyObject *ox, *oy;
    int r0;
    if (!PyArg_ParseTuple(args, "OOi", &ox, &oy, &r0)) return NULL;
    Held h = {.n = 0};
    Py_buffer *x, *y;
    if (!(x = take(&h, ox, 0, 2, op, "x")) || !(y = take(&h, oy, 1, 2, op, "y")))
        return NULL;
    Py_ssize_t lh = x->shape[0], lw = x->shape[1], R = y->shape[0], width = y->shape[1];
    if (lh < 1 || lw < 1) return fail(&h, op, "x must not be empty");
    if (width > 2 * lw) return fail(&h, op, "y is wider than the upsampled x");
    if (r0 < 0 || r0 + R > 2 * lh) return fail(&h, op, "rows r0 .. r0 + R are not all output rows");
    if (overlaps(y, x)) return fail(&h, op, "y must not overlap x");
    float *tmp = malloc((size_t)lw * sizeof(float));
    if (!tmp) return no_memory(&h);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < R; r++)
        bilinear_row(x->buf, (int)lh, (int)lw, (float *)y->buf + r * width, (int)width,
                     (int)(r0 + r), tmp);
    Py_END_ALLOW_THREADS;
    free(tmp);
    release(&h);
    Py_RETURN_NONE;
}

static const char BIAS_DOC[] =
    "bias_relu(o, b, res)\n\n"
    "o = relu(o + b (+ res)) in place (pwconv's epilogue, same order of additions);\n"
    "o [P, C], b [C], res None or [P, C].";

static PyObject *py_bias_relu(PyObject *self, PyObject *args) {
    (void)self;
    static const char *op = "bias_relu";
    PyObject *oo, *ob, *ores;
    if (!PyArg_ParseTuple(args, "OOO", &oo, &ob, &ores)) return NULL;
    Held h = {.n = 0};
    Py_buffer *o, *b, *res = NULL;
    if (!(o = take(&h, oo, 1, 2, op, "o")) || !(b = take(&h, ob, 0, 1, op, "b")) ||
        (ores != Py_None && !(res = take(&h, ores, 0, 2, op, "res"))))
        return NULL;
    Py_ssize_t P = o->shape[0], C = o->shape[1];
    if (!shape_is(b, C, 0, 0, 1)) return fail(&h, op, "b must have shape [C] of o");
    if (res && !shape_is(res, P, C, 0, 2)) return fail(&h, op, "res must have o's shape");
    if (overlaps(o, b) || (res && res->buf != o->buf && overlaps(o, res)))
        return fail(&h, op, "o must not overlap b or res");
    float *out = o->buf;
    const float *bias = b->buf, *r = res ? res->buf : NULL;
    Py_BEGIN_ALLOW_THREADS;
    K->bias_relu(out, bias, r, P, (int)C);
    Py_END_ALLOW_THREADS;
    release(&h);
    Py_RETURN_NONE;
}

/* ---- where the band threads run ---------------------------------------------------------
 * A pool thread woken by the caller is often placed on the caller's own CPU (the kernel's
 * wake-affine placement), and the two bands of a layer then share one core until the load
 * balancer separates them: after half a second idle, the first three or four 200x200
 * forwards ran at one-thread speed. leave_cpu moves the calling thread off a CPU at once
 * (an affinity mask without it, then the old mask back: no lasting pinning). */

static PyObject *py_current_cpu(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(sched_getcpu());
}

static PyObject *py_leave_cpu(PyObject *self, PyObject *args) {
    (void)self;
    int cpu;
    if (!PyArg_ParseTuple(args, "i", &cpu)) return NULL;
    cpu_set_t old, other;
    int moved = 0;
    if (cpu >= 0 && cpu < CPU_SETSIZE && sched_getcpu() == cpu &&
        sched_getaffinity(0, sizeof old, &old) == 0) {
        other = old;
        CPU_CLR(cpu, &other);
        if (CPU_COUNT(&other) > 0 && sched_setaffinity(0, sizeof other, &other) == 0) {
            moved = 1;
            sched_setaffinity(0, sizeof old, &old);
        }
    }
    return PyBool_FromLong(moved);
}

static const Kernels *const ALL[] = {&kernels_baseline, &kernels_avx2, &kernels_avx512};
static size_t best = 0; /* ALL[best]: the widest this CPU runs */

static const char ISA_DOC[] =
    "use_isa(name) -> previous name\n\n"
    "Run the kernels compiled for 'baseline', 'avx2' or 'avx512' (tests; never above what\n"
    "this CPU supports: ValueError). Process-wide; the import picks the best.";

static PyObject *py_use_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (size_t i = 0; i < sizeof ALL / sizeof ALL[0]; i++) {
        if (strcmp(ALL[i]->isa, name) != 0) continue;
        if (i > best) break;
        const char *prev = K->isa;
        K = ALL[i];
        return PyUnicode_FromString(prev);
    }
    PyErr_Format(PyExc_ValueError, "use_isa: %s is not one of this CPU's ISAS (best: %s)", name,
                 ALL[best]->isa);
    return NULL;
}

static PyMethodDef methods[] = {
    {"use_isa", py_use_isa, METH_VARARGS, ISA_DOC},
    {"current_cpu", py_current_cpu, METH_NOARGS, "The CPU the calling thread runs on now."},
    {"leave_cpu", py_leave_cpu, METH_VARARGS,
     "leave_cpu(cpu) -> moved: move the calling thread off that CPU now if it runs there\n"
     "and may run elsewhere (its affinity mask is left as it was)."},
    {"dwconv3x3", py_dwconv3x3, METH_VARARGS, DW_DOC},
    {"dwconv3x3_join", py_dwconv3x3_join, METH_VARARGS, JOIN_DOC},
    {"stem3x3", py_stem3x3, METH_VARARGS, STEM_DOC},
    {"bias_relu", py_bias_relu, METH_VARARGS, BIAS_DOC},
    {"bilinear2x", py_bilinear2x, METH_VARARGS, BILINEAR_DOC},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "scratchd.cpu._cpu",
    "The CPU schedule's band kernels (see cpu/_cpu.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        best = 1;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) best = 2;
    }
    K = ALL[best];
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *isas = PyTuple_New((Py_ssize_t)best + 1);
    for (size_t i = 0; isas && i <= best; i++)
        PyTuple_SET_ITEM(isas, (Py_ssize_t)i, PyUnicode_FromString(ALL[i]->isa));
    if (!isas || PyModule_AddObject(m, "ISAS", isas) < 0) {
        Py_XDECREF(isas);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
