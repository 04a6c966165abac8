// ds_block: a whole depthwise-separable block in one kernel. Per tile of 64 output pixels the
// depthwise 3x3 (+ bias, ReLU) is computed straight into shared memory as the GEMM's A
// operand, multiplied by the pointwise weight on the tensor cores, and finished in the
// epilogue (bias, residual, ReLU; optionally the 1x1 head). With CB > 0 the input is the
// decoder join concat(nearest_upsample2x(x), skip), read on the fly (see DwSource).
#include "pw_tile.cuh"

template <int CA, int CB, int COUT, int STRIDE, int DIL, bool RES, bool HEAD>
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
    int N, int H, int W, int Ho, int Wo) {
    constexpr int CIN = CA + CB;
    using S = sd::PwShape<CIN, COUT>;
    constexpr int V = (CA % 8 == 0 && CB % 8 == 0) ? 8 : 1;
    constexpr int GROUPS = S::KP / V;
    static_assert(!RES || (STRIDE == 1 && CB == 0 && CA == COUT), "residual needs matching shapes");
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sW = reinterpret_cast<__half*>(smem);
    __half* sA = sW + S::NP * S::KS;
    sd::stage_weight<CIN, COUT>(pw_w, sW);
    const sd::DwSource<CA, CB> src{x, skip, H, W};
    const int plane = Ho * Wo, M = N * plane;
    const int tiles = (M + sd::PW_BM - 1) / sd::PW_BM;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int base = tile * sd::PW_BM;
        __syncthreads();  // sW staged / the previous tile's epilogue has read sC
        for (int i = threadIdx.x; i < sd::PW_BM * GROUPS; i += sd::PW_THREADS) {
            const int r = i / GROUPS, c = (i - r * GROUPS) * V, p = base + r;
            float v[V];
            if (p < M && c < CIN) {
                const int n = p / plane, rem = p - n * plane, oy = rem / Wo, ox = rem - oy * Wo;
                sd::dw_point<V, STRIDE, DIL, true>(src, dw_w, dw_b, n, oy, ox, c, v);
            } else {
                sd::fill<V>(v, 0.0f);
            }
            sd::store_h<V>(sA + r * S::KS + c, v);
        }
        __syncthreads();
        sd::gemm_tile<CIN, COUT>(sW, sA, pw_b);
        if constexpr (HEAD) {
            sd::store_tile_head<COUT, RES, true>(sA, x, head_w, head_b[0], static_cast<float*>(out), base, M);
        } else {
            sd::store_tile<COUT, RES, true>(sA, x, static_cast<__half*>(out), base, M);
        }
    }
}
