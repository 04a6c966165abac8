/* scratchd.kernels._cpu: the CPU schedule's per-band kernels, in one pass over memory.
 *
 * Called by kernels/cpu_schedule.py on one band (a run of output rows of one image) at a
 * time, from several Python threads at once: every function releases the GIL while it
 * computes and writes only the output band it was given, so bands run truly in parallel.
 * The numpy references in kernels/<op>.py are the definition; tests/kernels/test__cpu.py
 * compares every function here with them.
 *
 * Layouts (all float32, C-contiguous, channels last = contiguous):
 *
 *   x    [H, W, C]         one image's activations (the NHWC batch's x[i])
 *   w    [3, 3, C]         depthwise taps, w[ky, kx, c]
 *   b    [C]               folded-BN bias
 *   y    [R, Wo, C]        output rows r0 .. r0 + R - 1 (a band; r0 + R <= Ho)
 *
 *   one output row of y:   | px 0: c0 c1 .. cC-1 | px 1: c0 .. | ... | px Wo-1 |
 *   vector loop:            ^^^^^^^^ 8 channels at a time, 4 pixels at a time, the 9 tap
 *                           weights of those 8 channels held in registers
 *
 * Arithmetic order matches the references: acc = b, then acc += x * w tap by tap in
 * (ky, kx) order, each product and sum rounded to float32 (the module is built without
 * -ffp-contract=fast, so no FMA contraction), then ReLU. Rows above/below the image read a
 * zero row (0 * w adds exactly nothing, as the reference's zero padding); columns outside
 * the image are skipped on the few edge pixels, which take a scalar path.
 *
 * Instruction sets: the kernels are compiled three times (baseline x86-64 / AVX2+FMA /
 * AVX-512VL) from the same source with GCC vector extensions and picked once at import by
 * __builtin_cpu_supports; vectors are 8 floats (a ymm register), wider ones gain nothing
 * on the Zen 4 cores this is tuned on, which split 512-bit operations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Every function taking or returning a vector is always_inline: no vector crosses a call,
 * so the baseline build's "AVX vector return changes the ABI" note (-Wpsabi, silenced in
 * setup.py) does not apply. */
#define ALWAYS static inline __attribute__((always_inline))
#define V 8 /* floats per vector */
#define PX 4 /* output pixels per vector-loop iteration (independent sums in flight) */

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

ALWAYS v8 vload(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS void vstore(float *p, v8 v) { memcpy(p, &v, sizeof v); }

ALWAYS v8 vrelu(v8 v) { /* max(v, 0); NaN becomes 0 */
    v8 zero = {0};
    return (v8)((v8i)v & (v > zero));
}

ALWAYS float relu(float v) { return v > 0.0f ? v : 0.0f; }

/* One run of output pixels p0 .. p1-1 along a row: out[p] = relu(b + sum over taps of
 * row[r][base(p) + col[k] + c] * w[(r * nk + k) * wstep + c]), base(p) = p * in_step. */
typedef struct {
    const float *row[3]; /* input row of each row tap (a zero row where outside the image) */
    ptrdiff_t col[3];    /* offset of each column tap from the pixel's base, in floats */
    const float *w;      /* tap weights */
    ptrdiff_t wstep;     /* floats between taps in w */
    const float *b;      /* [C] */
    ptrdiff_t in_step;   /* input floats per output pixel (stride * channels) */
    float *out;          /* output pixel 0 */
    ptrdiff_t out_step;  /* output floats per output pixel */
    int C;
} Run;

/* All column taps of p0 .. p1-1 inside the image: the vector loop. PX pixels at a time
 * (independent sums in flight), all channels of those pixels before the next ones (each
 * input and output cache line is used whole while it is in L1); a tap's 8 weights are
 * loaded once per PX pixels. nr, nk are constants at every call site, so the tap loops
 * unroll. */
ALWAYS void run_interior(const Run *r, int nr, int nk, int p0, int p1) {
    const int nt = nr * nk, C = r->C, cv = C - C % V;
    const ptrdiff_t is = r->in_step, os = r->out_step;
    const float *src[9];
    for (int t = 0; t < nt; t++) src[t] = r->row[t / nk] + r->col[t % nk];
    int p = p0;
    for (; p + PX <= p1; p += PX) {
        const ptrdiff_t in = p * is;
        float *out = r->out + p * os;
        for (int c = 0; c < cv; c += V) {
            v8 a[PX];
            const v8 b = vload(r->b + c);
            for (int q = 0; q < PX; q++) a[q] = b;
            for (int t = 0; t < nt; t++) {
                const v8 w = vload(r->w + t * r->wstep + c);
                for (int q = 0; q < PX; q++) a[q] += vload(src[t] + in + q * is + c) * w;
            }
            for (int q = 0; q < PX; q++) vstore(out + q * os + c, vrelu(a[q]));
        }
    }
    for (; p < p1; p++)
        for (int c = 0; c < cv; c += V) {
            v8 a = vload(r->b + c);
            for (int t = 0; t < nt; t++)
                a += vload(src[t] + p * is + c) * vload(r->w + t * r->wstep + c);
            vstore(r->out + p * os + c, vrelu(a));
        }
    for (int c = cv; c < C; c++) /* channels past the last multiple of 8 */
        for (p = p0; p < p1; p++) {
            float a = r->b[c];
            for (int t = 0; t < nt; t++) a += src[t][p * is + c] * r->w[t * r->wstep + c];
            r->out[p * os + c] = relu(a);
        }
}

/* One pixel whose column taps are only partly inside the image (bit k of mask: tap k is). */
ALWAYS void run_edge(const Run *r, int nr, int nk, int p, unsigned mask) {
    const int nt = nr * nk, C = r->C, cv = C - C % V;
    const ptrdiff_t in = p * r->in_step;
    float *out = r->out + p * r->out_step;
    for (int c = 0; c < cv; c += V) {
        v8 a = vload(r->b + c);
        for (int t = 0; t < nt; t++)
            if (mask >> (t % nk) & 1u)
                a += vload(r->row[t / nk] + in + r->col[t % nk] + c) *
                     vload(r->w + t * r->wstep + c);
        vstore(out + c, vrelu(a));
    }
    for (int c = cv; c < C; c++) {
        float a = r->b[c];
        for (int t = 0; t < nt; t++)
            if (mask >> (t % nk) & 1u)
                a += r->row[t / nk][in + r->col[t % nk] + c] * r->w[t * r->wstep + c];
        out[c] = relu(a);
    }
}

/* ---- the kernels, compiled once per instruction set ----------------------------------- */

/* A depthwise 3x3 over one output row: image [h, w, c] (pixel stride px floats), stride s,
 * dilation d, weights/bias with tap stride wstep, into out (pixel stride os). */
typedef struct {
    const float *x;
    int h, w, c, s, d;
    ptrdiff_t px, wstep;
    const float *wt, *b, *zero;
    float *out;
    ptrdiff_t os;
    int wo;
} DwRow;

ALWAYS void dw_row_body(const DwRow *g, int oy) {
    Run r = {.w = g->wt, .wstep = g->wstep, .b = g->b, .in_step = g->s * g->px, .out = g->out,
             .out_step = g->os, .C = g->c};
    for (int k = 0; k < 3; k++) {
        int iy = g->s * oy + g->d * (k - 1);
        r.row[k] = (iy >= 0 && iy < g->h) ? g->x + (ptrdiff_t)iy * g->w * g->px : g->zero;
        r.col[k] = (ptrdiff_t)g->d * (k - 1) * g->px;
    }
    /* Interior: s*p - d >= 0 and s*p + d <= w - 1. */
    int lo = (g->d + g->s - 1) / g->s;
    int hi = g->w - 1 - g->d >= 0 ? (g->w - 1 - g->d) / g->s + 1 : 0;
    if (hi > g->wo) hi = g->wo;
    if (hi < lo) hi = lo;
    if (lo < hi) run_interior(&r, 3, 3, lo, hi);
    for (int p = 0; p < g->wo; p++) {
        if (p >= lo && p < hi) continue;
        unsigned mask = 0;
        for (int k = 0; k < 3; k++) {
            int ix = g->s * p + g->d * (k - 1);
            mask |= (unsigned)(ix >= 0 && ix < g->w) << k;
        }
        run_edge(&r, 3, 3, p, mask);
    }
}

/* The upsampled half of a decoder join, one output row oy (module doc of cpu_schedule):
 * output pixel (oy, 2j + bb) is a 2x2 convolution of the low-res image at row oy / 2,
 * column j, with the phase's summed weights wph[(a * 2 + bb) * 4 + ty * 2 + tx][c]. */
typedef struct {
    const float *x; /* [h, w, c1] */
    int h, w, c1;
    const float *wph, *b, *zero;
    float *out; /* output row: [2w, cy] */
    int cy;
} UpRow;

ALWAYS void up_row_body(const UpRow *g, int oy) {
    const int a = oy & 1, i = oy >> 1;
    for (int bb = 0; bb < 2; bb++) {
        Run r = {.w = g->wph + (ptrdiff_t)(a * 2 + bb) * 4 * g->c1, .wstep = g->c1,
                 .b = g->b, .in_step = g->c1, .out = g->out + (ptrdiff_t)bb * g->cy,
                 .out_step = 2 * (ptrdiff_t)g->cy, .C = g->c1};
        for (int t = 0; t < 2; t++) {
            int iy = i + t - 1 + a; /* a = 0: rows i-1, i; a = 1: rows i, i+1 */
            r.row[t] = (iy >= 0 && iy < g->h) ? g->x + (ptrdiff_t)iy * g->w * g->c1 : g->zero;
            r.col[t] = (ptrdiff_t)(t - 1 + bb) * g->c1;
        }
        /* bb = 0 reads columns j-1, j (interior j >= 1); bb = 1 reads j, j+1 (j <= w-2). */
        int lo = bb == 0 ? 1 : 0, hi = bb == 0 ? g->w : g->w - 1;
        if (lo < hi) run_interior(&r, 2, 2, lo, hi);
        int edge = bb == 0 ? 0 : g->w - 1;
        if (!(edge >= lo && edge < hi)) run_edge(&r, 2, 2, edge, bb == 0 ? 2u : 1u);
    }
}

/* The stem: a 3x3 convolution of a one-channel image [h, w], stride 2, zero padding 1, into
 * one output row [wo, cout]; out = relu(b + sum_t x_t * w[t]) (tap order ky, kx). */
typedef struct {
    const float *x;
    int h, w, cout;
    const float *wt, *b;
    float *out;
    int wo;
} StemRow;

ALWAYS void stem_row_body(const StemRow *g, int oy) {
    for (int p = 0; p < g->wo; p++) {
        float s[9];
        for (int t = 0; t < 9; t++) {
            int iy = 2 * oy + t / 3 - 1, ix = 2 * p + t % 3 - 1;
            s[t] = (iy >= 0 && iy < g->h && ix >= 0 && ix < g->w) ? g->x[iy * g->w + ix] : 0.0f;
        }
        float *o = g->out + (ptrdiff_t)p * g->cout;
        int c = 0;
        for (; c + V <= g->cout; c += V) {
            v8 a = vload(g->b + c);
            for (int t = 0; t < 9; t++) a += s[t] * vload(g->wt + t * g->cout + c);
            vstore(o + c, vrelu(a));
        }
        for (; c < g->cout; c++) {
            float a = g->b[c];
            for (int t = 0; t < 9; t++) a += s[t] * g->wt[t * g->cout + c];
            o[c] = relu(a);
        }
    }
}

/* The head's bilinear 2x upsampling (kernels/upsample_bilinear2x.py) of a one-channel
 * image [h, w], output row oy cropped to width columns, in the reference's exact float32
 * operations (0.75 * centre + 0.25 * clamped neighbour, rows first, then columns; no FMA:
 * the module is built with -ffp-contract=off, the ISO C default), so that the result is
 * bit for bit the reference's. tmp holds one upsampled-by-rows low-res row [w]. */
static void bilinear_row(const float *x, int h, int w, float *out, int width, int oy,
                         float *tmp) {
    const int i = oy >> 1, n = oy & 1 ? (i + 1 < h ? i + 1 : h - 1) : (i > 0 ? i - 1 : 0);
    const float *c = x + (ptrdiff_t)i * w, *o = x + (ptrdiff_t)n * w;
    for (int j = 0; j < w; j++) {
        float m = 0.75f * c[j], q = 0.25f * o[j];
        tmp[j] = m + q;
    }
    for (int k = 0; k < width; k++) {
        const int j = k >> 1, jn = k & 1 ? (j + 1 < w ? j + 1 : w - 1) : (j > 0 ? j - 1 : 0);
        float m = 0.75f * tmp[j], q = 0.25f * tmp[jn];
        out[k] = m + q;
    }
}

/* o = relu(o + b (+ res)) over n pixels of c channels: the pointwise conv's epilogue. */
ALWAYS void bias_relu_body(float *o, const float *b, const float *res, ptrdiff_t n, int c) {
    for (ptrdiff_t p = 0; p < n; p++) {
        float *op = o + p * c;
        const float *rp = res ? res + p * c : NULL;
        if (rp)
            for (int k = 0; k < c; k++) op[k] = relu(op[k] + b[k] + rp[k]);
        else
            for (int k = 0; k < c; k++) op[k] = relu(op[k] + b[k]);
    }
}

typedef struct {
    void (*dw_row)(const DwRow *, int);
    void (*up_row)(const UpRow *, int);
    void (*stem_row)(const StemRow *, int);
    void (*bias_relu)(float *, const float *, const float *, ptrdiff_t, int);
    const char *isa;
} Kernels;

#define DEFINE_KERNELS(SUFFIX, ATTR)                                                        \
    ATTR static void dw_row_##SUFFIX(const DwRow *g, int oy) { dw_row_body(g, oy); }        \
    ATTR static void up_row_##SUFFIX(const UpRow *g, int oy) { up_row_body(g, oy); }        \
    ATTR static void stem_row_##SUFFIX(const StemRow *g, int oy) { stem_row_body(g, oy); }  \
    ATTR static void bias_relu_##SUFFIX(float *o, const float *b, const float *res,         \
                                        ptrdiff_t n, int c) {                               \
        bias_relu_body(o, b, res, n, c);                                                    \
    }                                                                                       \
    static const Kernels kernels_##SUFFIX = {dw_row_##SUFFIX, up_row_##SUFFIX,              \
                                             stem_row_##SUFFIX, bias_relu_##SUFFIX, #SUFFIX};

DEFINE_KERNELS(baseline, )
DEFINE_KERNELS(avx2, __attribute__((target("avx2,fma"))))
DEFINE_KERNELS(avx512, __attribute__((target("avx512f,avx512vl,avx2,fma"))))

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
        PyErr_Format(PyExc_ValueError, "%s: %s must be float32 with %d axes (got format %s, %d axes)",
                     op, name, ndim, v->format ? v->format : "B", v->ndim);
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

static Py_buffer *take(Held *h, PyObject *obj, int writable, int ndim, const char *op,
                       const char *name) {
    if (get_f32(obj, &h->v[h->n], writable, ndim, op, name) < 0) return NULL;
    return &h->v[h->n++];
}

static PyObject *fail(Held *h, const char *op, const char *msg) {
    release(h);
    PyErr_Format(PyExc_ValueError, "%s: %s", op, msg);
    return NULL;
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
        !(b = take(&h, ob, 0, 1, op, "b")) || !(y = take(&h, oy, 1, 3, op, "y"))) {
        release(&h);
        return NULL;
    }
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
    if (!zero) {
        release(&h);
        return PyErr_NoMemory();
    }
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
        !(y = take(&h, oy, 1, 3, op, "y"))) {
        release(&h);
        return NULL;
    }
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
        release(&h);
        return PyErr_NoMemory();
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
        !(b = take(&h, ob, 0, 1, op, "b")) || !(y = take(&h, oy, 1, 3, op, "y"))) {
        release(&h);
        return NULL;
    }
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
    if (!(x = take(&h, ox, 0, 2, op, "x")) || !(y = take(&h, oy, 1, 2, op, "y"))) {
        release(&h);
        return NULL;
    }
    Py_ssize_t lh = x->shape[0], lw = x->shape[1], R = y->shape[0], width = y->shape[1];
    if (lh < 1 || lw < 1) return fail(&h, op, "x must not be empty");
    if (width > 2 * lw) return fail(&h, op, "y is wider than the upsampled x");
    if (r0 < 0 || r0 + R > 2 * lh) return fail(&h, op, "rows r0 .. r0 + R are not all output rows");
    if (overlaps(y, x)) return fail(&h, op, "y must not overlap x");
    float *tmp = malloc((size_t)lw * sizeof(float));
    if (!tmp) {
        release(&h);
        return PyErr_NoMemory();
    }
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
        (ores != Py_None && !(res = take(&h, ores, 0, 2, op, "res")))) {
        release(&h);
        return NULL;
    }
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
    {"dwconv3x3", py_dwconv3x3, METH_VARARGS, DW_DOC},
    {"dwconv3x3_join", py_dwconv3x3_join, METH_VARARGS, JOIN_DOC},
    {"stem3x3", py_stem3x3, METH_VARARGS, STEM_DOC},
    {"bias_relu", py_bias_relu, METH_VARARGS, BIAS_DOC},
    {"bilinear2x", py_bilinear2x, METH_VARARGS, BILINEAR_DOC},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "scratchd.kernels._cpu",
    "The CPU schedule's band kernels (see kernels/_cpu.c).", -1, methods,
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
