// ds_block: a whole depthwise-separable block in one kernel. Per tile of 64 output pixels the
// depthwise 3x3 (+ bias, ReLU) is computed straight into shared memory as the GEMM's A
// operand, multiplied by the pointwise weight on the tensor cores, and finished in the
// epilogue (bias, residual, ReLU; optionally the 1x1 head). With CB > 0 the input is the
// decoder join concat(nearest_upsample2x(x), skip), read on the fly (see DwSource).
//
// Depthwise stage: one thread computes P horizontally adjacent output pixels (one row: the
// host picks P | Wo, so a group never wraps) for V = 8 channels. Each input column the P
// outputs share is loaded and converted once (a 3x3 stride-1 row of 4 outputs reads 6
// columns instead of 12), and the depthwise weight sits in shared memory as fp32, so the
// inner loop is mostly FMAs. With HOIST (and at most 18 loads a group) all three rows are
// loaded before any is used: one memory round trip per group instead of three, for more
// registers. Arithmetic is fp32 throughout; storage fp16.
//
//   extra shared memory after pw_tile.cuh's: sDw [9][KP] float (zero beyond Cin)
#include "pw_tile.cuh"

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

template <int CA, int CB, int COUT, int NS, int STRIDE, int DIL, int P, bool HOIST, bool RES, bool HEAD>
__global__ void __launch_bounds__(sd::PW_THREADS) ds_block(
    const __half* __restrict__ x,     // [N, H, W, CA]; with CB > 0: [N, H/2, W/2, CA]
    const __half* __restrict__ skip,  // [N, H, W, CB] (CB > 0 only)
    const __half* __restrict__ dw_w,  // [3, 3, CA + CB]
    const float* __restrict__ dw_b,   // [CA + CB]
    const __half* __restrict__ pw_w,  // [CA + CB, COUT]
    const float* __restrict__ pw_b,   // [COUT]
    const float* __restrict__ head_w, // [COUT] (HEAD only)
    const float* __restrict__ head_b, // [1] (HEAD only)
    void* __restrict__ out,           // [N, Ho, Wo, COUT] half; HEAD: [N, Ho, Wo, 1] float
    int N, int H, int W, int Ho, int Wo) {  // Wo % P == 0
    constexpr int CIN = CA + CB;
    constexpr int CO = COUT / NS;  // this block's slice of the output channels (blockIdx.y)
    static_assert(COUT % NS == 0 && (NS == 1 || CO % 8 == 0), "slices of whole 8-channel groups");
    static_assert(!HEAD || NS == 1, "the head needs every channel of a pixel in one block");
    using S = sd::PwShape<CIN, CO>;
    const int n0 = blockIdx.y * CO;
    constexpr int V = (CA % 8 == 0 && CB % 8 == 0) ? 8 : 1;
    constexpr int GROUPS = S::KP / V;
    static_assert(!RES || (STRIDE == 1 && CB == 0 && CA == COUT), "residual needs matching shapes");
    static_assert(sd::PW_BM % P == 0, "a tile holds whole P-groups");
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sW = reinterpret_cast<__half*>(smem);
    __half* sA = sW + S::NP * S::KS;
    float* sDw = reinterpret_cast<float*>(sA + S::AREA);
    for (int i = threadIdx.x; i < 9 * S::KP; i += sd::PW_THREADS) {
        const int t = i / S::KP, c = i - t * S::KP;
        sDw[i] = c < CIN ? __half2float(dw_w[t * CIN + c]) : 0.0f;
    }
    sd::stage_weight<CIN, CO>(pw_w, sW, COUT, n0);
    const sd::DwSource<CA, CB> src{x, skip, H, W};
    const int plane = Ho * Wo, M = N * plane;
    const int tiles = (M + sd::PW_BM - 1) / sd::PW_BM;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int base = tile * sd::PW_BM;
        __syncthreads();  // weights staged / the previous tile's epilogue has read sC
        for (int i = threadIdx.x; i < (sd::PW_BM / P) * GROUPS; i += sd::PW_THREADS) {
            const int g = i / GROUPS, c = (i - g * GROUPS) * V, r0 = g * P, p0 = base + r0;
            float acc[P][V];
            if (p0 < M && c < CIN) {  // M is a multiple of P: the whole group is valid
                const int n = p0 / plane, rem = p0 - n * plane, oy = rem / Wo, ox0 = rem - oy * Wo;
                sd::dw_row_group<V, P, STRIDE, DIL, HOIST, S::KP>(src, sDw, dw_b, n, oy, ox0, c, acc);
            } else {
#pragma unroll
                for (int q = 0; q < P; ++q) sd::fill<V>(acc[q], 0.0f);
            }
#pragma unroll
            for (int q = 0; q < P; ++q) sd::store_h<V>(sA + (r0 + q) * S::KS + c, acc[q]);
        }
        __syncthreads();
        sd::gemm_tile<CIN, CO>(sW, sA, pw_b + n0);
        if constexpr (HEAD) {
            sd::store_tile_head<CO, RES, true>(sA, x, head_w, head_b[0], static_cast<float*>(out), base, M);
        } else {
            sd::store_tile<CO, RES, true>(sA, x, static_cast<__half*>(out), base, M, COUT, n0);
        }
    }
}
