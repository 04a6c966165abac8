// stem: the input path fused with the first conv. uint8 frames are normalised
// ((x/255 - mean)/std), edge-padded to [Hp, Wp] (clamped reads) and convolved (3x3, stride 2,
// zero padding 1 around the padded frame, 1 → COUT channels, bias, ReLU) in one pass: the
// normalised fp16 input never exists in memory. One thread per output pixel, all COUT
// channels (COUT/8 16-byte stores, contiguous across the warp); the weight lives in shared
// memory as fp32 and is read as a broadcast.
#include "common.cuh"

template <int COUT>
__global__ void __launch_bounds__(256) stem(
    const unsigned char* __restrict__ images,  // [N, H, W]
    const __half* __restrict__ w,              // [3, 3, 1, COUT]
    const float* __restrict__ b,               // [COUT]
    __half* __restrict__ out,                  // [N, Ho, Wo, COUT], Ho = Hp / 2, Wo = Wp / 2
    int N, int H, int W, int Hp, int Wp, int Ho, int Wo,
    float scale,                               // 1 / (255 * std)
    float shift) {                             // -mean / std
    constexpr int V = sd::VecWidth<COUT>::value;
    __shared__ __align__(16) float sw[9 * COUT];  // [tap][COUT]
    __shared__ float sb[COUT];
    for (int i = threadIdx.x; i < 9 * COUT; i += blockDim.x) sw[i] = __half2float(w[i]);
    for (int i = threadIdx.x; i < COUT; i += blockDim.x) sb[i] = b[i];
    __syncthreads();
    const int plane = Ho * Wo, items = N * plane;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < items; p += gridDim.x * blockDim.x) {
        const int n = p / plane, rem = p - n * plane, oy = rem / Wo, ox = rem - oy * Wo;
        const unsigned char* img = images + n * H * W;
        float v[9];
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            const int iy = 2 * oy + ky - 1;
#pragma unroll
            for (int kx = 0; kx < 3; ++kx) {
                const int ix = 2 * ox + kx - 1;
                const bool inside = iy >= 0 && iy < Hp && ix >= 0 && ix < Wp;
                const int sy = min(max(iy, 0), H - 1), sx = min(max(ix, 0), W - 1);
                v[ky * 3 + kx] = inside ? fmaf((float)img[sy * W + sx], scale, shift) : 0.0f;
            }
        }
#pragma unroll 1  // one channel group at a time: 8 accumulators, weights from shared memory
        for (int c0 = 0; c0 < COUT; c0 += V) {
            float acc[V];
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = sb[c0 + j];
#pragma unroll
            for (int t = 0; t < 9; ++t) {
                float wv[V];
                sd::load_f_smem<V>(sw + t * COUT + c0, wv);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = fmaf(v[t], wv[j], acc[j]);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = fmaxf(acc[j], 0.0f);
            sd::store_h<V>(out + p * COUT + c0, acc);
        }
    }
}
