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
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            float w[3][V];
#pragma unroll
            for (int kx = 0; kx < 3; ++kx) load_f_smem<V>(sDw + (ky * 3 + kx) * KP + c, w[kx]);
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
#pragma unroll
            for (int kx = 0; kx < 3; ++kx) load_f_smem<V>(sDw + (ky * 3 + kx) * KP + c, w[kx]);
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
