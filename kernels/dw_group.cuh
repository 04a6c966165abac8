// The depthwise stage shared by ds_block.cu (into shared memory, as the GEMM's A operand) and
// ds_split.cu (into a scratch tensor): relu(b + dw3x3) for P horizontally adjacent output
// pixels (one row: the host picks P | Wo, so a group never wraps) and V = 8 channels.
//
// Each input column the P outputs share is loaded and converted once (a 3x3 stride-1 row of
// 4 outputs reads 6 columns instead of 12), and the depthwise weight sits in shared memory as
// fp32 (sDw [9][KP], zero beyond Cin), so the inner loop is mostly FMAs. With HOIST (and at
// most 18 loads a group) all three rows are loaded before any is used: one memory round trip
// per group instead of three, for more registers. Arithmetic is fp32 throughout; every output
// sums its taps in the order (ky, kx) after the bias, like sd::dw_point.
#pragma once
#include "common.cuh"

namespace sd {

// Does input column j (relative to the first one a P-group reads) feed any output q, tap kx?
template <int P, int STRIDE, int DIL>
__device__ constexpr bool column_used(int j) {
    for (int q = 0; q < P; ++q)
        for (int kx = 0; kx < 3; ++kx)
            if (q * STRIDE + kx * DIL == j) return true;
    return false;
}

// acc[q] += v * w[kx] for every output q and tap kx that read input column j.
template <int V, int P, int STRIDE, int DIL>
__device__ __forceinline__ void add_column(
    int j, const float (&v)[V], const float (&w)[3][V], float (&acc)[P][V]) {
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
        for (int kx = 0; kx < 3; ++kx)
            if (q * STRIDE + kx * DIL == j) {
#pragma unroll
                for (int e = 0; e < V; ++e) acc[q][e] = fmaf(v[e], w[kx][e], acc[q][e]);
            }
}

// The 3 x NC input vectors of a P-group (channels [c, c + V)), zeros standing in for the
// padding and for columns no output reads.
template <int V, int P, int STRIDE, int DIL, int CA, int CB>
__device__ __forceinline__ void load_rows(
    const DwSource<CA, CB>& src, int n, int oy, int x_first, int c,
    RawH<V> (&raw)[3][(P - 1) * STRIDE + 2 * DIL + 1]) {
    constexpr int NC = (P - 1) * STRIDE + 2 * DIL + 1;
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
        const int iy = oy * STRIDE + (ky - 1) * DIL;
        const bool row_in = iy >= 0 && iy < src.H;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            const int ix = x_first + j;
            if (column_used<P, STRIDE, DIL>(j) && row_in && ix >= 0 && ix < src.W) {
                raw[ky][j] = load_raw<V>(src.at(n, iy, ix, c));
            } else {
                raw[ky][j] = zero_raw<V>();
            }
        }
    }
}

// load_rows for the decoder join's upsampled channels (c < CA; stride 1, dilation 1, P even,
// so the group starts at an even column): nearest 2x upsampling makes neighbouring virtual
// pixels copies of one source pixel, so the 3 x (P + 2) virtual inputs come from 2 source rows
// x (P / 2 + 2) source columns, loaded once each (8 loads instead of 18 for P = 4). Virtual
// row oy + ky - 1 is source row sr = (oy + ky - 1) >> 1: ky 0 → the first of the two, ky 2 →
// the second, ky 1 → the first when oy is odd; virtual column x_first + j is source column
// (j + 1) >> 1 of the group's. A virtual pixel is inside the frame exactly when its source
// pixel is inside the source (the frame is twice the source), so the padding zeros are the
// same. The values are the same as load_rows', so every sum is too.
template <int V, int P, int CA, int CB>
__device__ __forceinline__ void up_rows(
    const DwSource<CA, CB>& src, int n, int oy, int x_first, int c, RawH<V> (&raw)[3][P + 2]) {
    static_assert(P % 2 == 0, "an even group: it starts at an even column");
    constexpr int NS = P / 2 + 2;
    const int h = src.H >> 1, w = src.W >> 1, sy0 = (oy - 1) >> 1, sx0 = x_first >> 1;
    RawH<V> s[2][NS];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int sy = sy0 + r;
        const bool row_in = sy >= 0 && sy < h;
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            const int sx = sx0 + k;
            s[r][k] = (row_in && sx >= 0 && sx < w)
                          ? load_raw<V>(src.a + ((n * h + sy) * w + sx) * CA + c)
                          : zero_raw<V>();
        }
    }
    const bool odd = oy & 1;
#pragma unroll
    for (int j = 0; j < P + 2; ++j) {
        raw[0][j] = s[0][(j + 1) >> 1];
        raw[1][j] = odd ? s[0][(j + 1) >> 1] : s[1][(j + 1) >> 1];
        raw[2][j] = s[1][(j + 1) >> 1];
    }
}

// w[kx] = the fp32 weights of taps (ky, kx), channels [c, c + V), from sDw [9][KP].
template <int V, int KP>
__device__ __forceinline__ void row_weights(const float* sDw, int ky, int c, float (&w)[3][V]) {
#pragma unroll
    for (int kx = 0; kx < 3; ++kx) load_f_smem<V>(sDw + (ky * 3 + kx) * KP + c, w[kx]);
}

// acc[q] = relu(b + dw3x3 at (n, oy, ox0 + q)) for q < P, channels [c, c + V).
template <int V, int P, int STRIDE, int DIL, bool HOIST, int KP, int CA, int CB>
__device__ __forceinline__ void dw_row_group(
    const DwSource<CA, CB>& src, const float* sDw, const float* __restrict__ b,
    int n, int oy, int ox0, int c, float (&acc)[P][V]) {
    constexpr int NC = (P - 1) * STRIDE + 2 * DIL + 1;
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[q][e] = __ldg(b + c + e);
    const int x_first = ox0 * STRIDE - DIL;
    if constexpr (HOIST && 3 * NC <= 18) {
        // Few enough columns: issue all 3 rows' loads first (one memory round trip per
        // group instead of one per row), zeros standing in for the padding.
        RawH<V> raw[3][NC];
        if constexpr (CB > 0 && STRIDE == 1 && DIL == 1 && P % 2 == 0) {
            if (c < CA) {  // the join's upsampled part: see up_rows
                up_rows<V, P>(src, n, oy, x_first, c, raw);
            } else {
                load_rows<V, P, STRIDE, DIL>(src, n, oy, x_first, c, raw);
            }
        } else {
            load_rows<V, P, STRIDE, DIL>(src, n, oy, x_first, c, raw);
        }
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            float w[3][V];
            row_weights<V, KP>(sDw, ky, c, w);
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (!column_used<P, STRIDE, DIL>(j)) continue;
                float v[V];
                unpack<V>(raw[ky][j], v);
                add_column<V, P, STRIDE, DIL>(j, v, w, acc);
            }
        }
    } else {
        // Many columns (dilated or strided sweeps): row by row, to bound the registers.
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            const int iy = oy * STRIDE + (ky - 1) * DIL;
            if (iy < 0 || iy >= src.H) continue;
            float w[3][V];
            row_weights<V, KP>(sDw, ky, c, w);
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (!column_used<P, STRIDE, DIL>(j)) continue;
                const int ix = x_first + j;
                if (ix < 0 || ix >= src.W) continue;
                float v[V];
                load_h<V>(src.at(n, iy, ix, c), v);
                add_column<V, P, STRIDE, DIL>(j, v, w, acc);
            }
        }
    }
#pragma unroll
    for (int q = 0; q < P; ++q)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[q][e] = fmaxf(acc[q][e], 0.0f);
}

}  // namespace sd
