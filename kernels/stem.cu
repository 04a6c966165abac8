// stem: the input path fused with the first conv. uint8 frames are normalised
// ((x/255 - mean)/std), edge-padded to [Hp, Wp] (clamped reads) and convolved (3x3, stride 2,
// zero padding 1 around the padded frame, 1 → COUT channels, bias, ReLU) in one pass: the
// normalised fp16 input never exists in memory.
//
// One thread per (P horizontally adjacent output pixels, group of V channels), groups
// fastest: the G = COUT / V threads of a P-group store one contiguous stretch of the output
// per pixel and read its 3 x (2P + 1) input bytes from L1 (neighbouring outputs share a
// column, and P > 1 spreads the index arithmetic over P pixels). Two blocks an SM: the
// register cap (128) costs P = 2 and 4 a few bytes of spill, one block (136-169 registers)
// would halve the warps. The block holds a whole number of pixels (THREADS = G * (256 / G))
// and the grid-stride step is a multiple of G, so a thread keeps one channel group for its
// whole loop, with that group's 9 x V weights (fp32) and V biases in registers: the inner
// loop is 9 x V FMAs and no shared memory. Each output sums bias, then taps in (ky, kx)
// order, in fp32 (as stem_ref's definition), so every sweep width gives the same bits.
#include "common.cuh"

template <int COUT, int P>
__global__ void __launch_bounds__(256, 2) stem(
    const unsigned char* __restrict__ images,  // [N, H, W]
    const __half* __restrict__ w,              // [3, 3, 1, COUT]
    const float* __restrict__ b,               // [COUT]
    __half* __restrict__ out,                  // [N, Ho, Wo, COUT], Ho = Hp / 2, Wo = Wp / 2
    int N, int H, int W, int Hp, int Wp, int Ho, int Wo,  // Wo % P == 0
    float scale,                               // 1 / (255 * std)
    float shift) {                             // -mean / std
    constexpr int V = sd::VecWidth<COUT>::value, G = COUT / V, NC = 2 * P + 1;
    static_assert(COUT % V == 0 && G <= 256, "whole channel groups, a pixel per block at least");
    const int stride = gridDim.x * blockDim.x;  // a multiple of G: blockDim.x is (host)
    const int first = blockIdx.x * blockDim.x + threadIdx.x, c0 = (first % G) * V;
    float wv[9][V], bv[V];
#pragma unroll
    for (int t = 0; t < 9; ++t)
#pragma unroll
        for (int j = 0; j < V; ++j) wv[t][j] = __half2float(w[t * COUT + c0 + j]);
#pragma unroll
    for (int j = 0; j < V; ++j) bv[j] = b[c0 + j];
    const int plane = Ho * Wo;
    const int items = N * plane / P * G;  // < 2^31: the host checks
    for (int i = first; i < items; i += stride) {
        const int p0 = i / G * P;  // P pixels of one row: Wo % P == 0
        const int n = p0 / plane, rem = p0 - n * plane, oy = rem / Wo, ox0 = rem - oy * Wo;
        const unsigned char* img = images + (size_t)n * H * W;
        // The 3 x (2P + 1) normalised inputs the P outputs read (neighbours share a column).
        float v[3][NC];
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            const int iy = 2 * oy + ky - 1;
            const int sy = min(max(iy, 0), H - 1);
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                const int ix = 2 * ox0 + j - 1;
                const bool inside = iy >= 0 && iy < Hp && ix >= 0 && ix < Wp;
                const int sx = min(max(ix, 0), W - 1);
                v[ky][j] = inside ? fmaf((float)__ldg(img + sy * W + sx), scale, shift) : 0.0f;
            }
        }
#pragma unroll
        for (int q = 0; q < P; ++q) {
            float acc[V];
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = bv[j];
#pragma unroll
            for (int t = 0; t < 9; ++t)
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = fmaf(v[t / 3][2 * q + t % 3], wv[t][j], acc[j]);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = fmaxf(acc[j], 0.0f);
            sd::store_h<V>(out + (size_t)(p0 + q) * COUT + c0, acc);
        }
    }
}
