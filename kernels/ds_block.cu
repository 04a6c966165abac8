// ds_block: a whole depthwise-separable block in one kernel. Per tile of 64 output pixels the
// depthwise 3x3 (+ bias, ReLU) is computed straight into shared memory as the GEMM's A
// operand, multiplied by the pointwise weight on the tensor cores, and finished in the
// epilogue (bias, residual, ReLU; optionally the 1x1 head). With CB > 0 the input is the
// decoder join concat(nearest_upsample2x(x), skip), read on the fly (see DwSource).
//
// Depthwise stage (dw_group.cuh): one thread computes P horizontally adjacent output pixels
// for V = 8 channels, from the fp32 weight in shared memory. Arithmetic is fp32 throughout;
// storage fp16.
//
//   extra shared memory after pw_tile.cuh's: sDw [9][KP] float (zero beyond Cin)
#include "pw_tile.cuh"
#include "dw_group.cuh"

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
            sd::store_tile_head<CO, RES>(sA, x, head_w, head_b[0], static_cast<float*>(out), base, M);
        } else {
            sd::store_tile<CO, RES, true>(sA, x, static_cast<__half*>(out), base, M, COUT, n0);
        }
    }
}
