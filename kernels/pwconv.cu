// pwconv: 1x1 convolution as a tensor-core GEMM [M, CIN] @ [CIN, COUT] (M = N*H*W pixels),
// with bias, optional residual add and activation in the epilogue (see pw_tile.cuh).
#include "pw_tile.cuh"

template <int CIN, int COUT, int NS, bool RES, bool RELU>
__global__ void __launch_bounds__(sd::PW_THREADS) pwconv(
    const __half* __restrict__ x,         // [N, H, W, CIN]
    const __half* __restrict__ w,         // [CIN, COUT]
    const float* __restrict__ b,          // [COUT]
    const __half* __restrict__ residual,  // [N, H, W, COUT] (read only when RES)
    __half* __restrict__ out,             // [N, H, W, COUT]
    int M) {                              // N * H * W
    constexpr int CO = COUT / NS;         // this block's slice of the output channels
    static_assert(COUT % NS == 0 && (NS == 1 || CO % 8 == 0), "slices of whole 8-channel groups");
    using S = sd::PwShape<CIN, CO>;
    const int n0 = blockIdx.y * CO;
    constexpr int V = sd::VecWidth<CIN>::value;
    constexpr int GROUPS = S::KP / V;
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sW = reinterpret_cast<__half*>(smem);
    __half* sA = sW + S::NP * S::KS;
    sd::stage_weight<CIN, CO>(w, sW, COUT, n0);
    const int tiles = (M + sd::PW_BM - 1) / sd::PW_BM;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int base = tile * sd::PW_BM;
        __syncthreads();  // sW staged / the previous tile's epilogue has read sC
        for (int i = threadIdx.x; i < sd::PW_BM * GROUPS; i += sd::PW_THREADS) {
            const int r = i / GROUPS, c = (i - r * GROUPS) * V, p = base + r;
            float v[V];
            if (p < M && c < CIN) sd::load_h<V>(x + p * CIN + c, v);
            else sd::fill<V>(v, 0.0f);
            sd::store_h<V>(sA + r * S::KS + c, v);
        }
        __syncthreads();
        sd::gemm_tile<CIN, CO>(sW, sA, b + n0);
        sd::store_tile<CO, RES, RELU>(sA, residual, out, base, M, COUT, n0);
    }
}
