/* scratchd.cpu._cpu's kernels: one output row at a time, no Python (see _cpu.c).
 *
 * Layouts (all float32, C-contiguous, channels last = contiguous):
 *
 *   x    [H, W, C]         one image's activations (the NHWC batch's x[i])
 *   w    [3, 3, C]         depthwise taps, w[ky, kx, c]
 *   b    [C]               folded-BN bias
 *   y    [R, Wo, C]        output rows r0 .. r0 + R - 1 (a band; r0 + R <= Ho)
 *
 *   one output row of y:   | px 0: c0 c1 .. cC-1 | px 1: c0 .. | ... | px Wo-1 |
 *   vector loop:            ^^^^^^^^ 8 channels at a time, the tap weights of those 8
 *                           channels in registers, over a tile of 8 pixels
 *
 * Arithmetic order matches the references: acc = b, then acc += x * w tap by tap in
 * (ky, kx) order, each product and sum rounded to float32 (the module is built without
 * -ffp-contract=fast, the ISO C default, so no FMA contraction), then ReLU. Rows above or
 * below the image read a zero row (0 * w adds exactly nothing, as the reference's zero
 * padding); columns outside the image are skipped on the few edge pixels.
 *
 * Every kernel body is an always_inline function, instantiated by DEFINE_KERNELS once per
 * instruction set (baseline x86-64, AVX2+FMA, AVX-512VL) from the same GCC vector-extension
 * source; _cpu.c picks one set at import with __builtin_cpu_supports. Vectors are 8 floats
 * (a ymm register): wider ones gain nothing on the Zen 4 cores this is tuned on, which
 * split 512-bit operations; AVX-512VL still gives 32 registers.
 */
#ifndef SCRATCHD_CPU_KERNELS_H
#define SCRATCHD_CPU_KERNELS_H

#include <stddef.h>
#include <string.h>

/* Every function taking or returning a vector is always_inline: no vector crosses a call,
 * so the baseline build's "AVX vector return changes the ABI" note (-Wpsabi, silenced in
 * setup.py) does not apply. */
#define ALWAYS static inline __attribute__((always_inline))
#define V 8 /* floats per vector */
#define TILE 8 /* output pixels per tile of the vector loop */

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

/* All column taps of p0 .. p1-1 inside the image: the vector loop. Pixels go in tiles of
 * TILE (the tile's input and output lines stay in L1 while every channel block passes over
 * them); per block of 8 channels the nr * nk tap weights sit in registers and each pixel
 * is nr * nk loads, multiplies and adds. Addresses are nr row pointers stepped pixel by
 * pixel plus the column-tap distance (a constant register), so nothing spills. nr, nk are
 * constants at every call site: the tap loops unroll. */
ALWAYS void run_interior(const Run *r, int nr, int nk, int p0, int p1) {
    const int nt = nr * nk, C = r->C, cv = C - C % V;
    const ptrdiff_t is = r->in_step, os = r->out_step, dk = r->col[1] - r->col[0];
    for (int t0 = p0; t0 < p1; t0 += TILE) {
        const int t1 = t0 + TILE < p1 ? t0 + TILE : p1;
        for (int c = 0; c < cv; c += V) {
            v8 w[9];
            const float *src[3];
            for (int t = 0; t < nt; t++) w[t] = vload(r->w + t * r->wstep + c);
            for (int q = 0; q < nr; q++) src[q] = r->row[q] + r->col[0] + t0 * is + c;
            const v8 b = vload(r->b + c);
            float *out = r->out + t0 * os + c;
            for (int p = t0; p < t1; p++) {
                v8 a = b;
                for (int t = 0; t < nt; t++) a += vload(src[t / nk] + (t % nk) * dk) * w[t];
                vstore(out, vrelu(a));
                for (int q = 0; q < nr; q++) src[q] += is;
                out += os;
            }
        }
    }
    for (int c = cv; c < C; c++) /* channels past the last multiple of 8 */
        for (int p = p0; p < p1; p++) {
            float a = r->b[c];
            for (int t = 0; t < nt; t++)
                a += r->row[t / nk][p * is + r->col[t % nk] + c] * r->w[t * r->wstep + c];
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

#endif
