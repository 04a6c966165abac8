// conv3x3: full 3x3 convolution (the stem), zero padding 1, stride, bias, activation.
// One thread per (output pixel, group of V output channels); the weight (fp32, at most
// 48 KB) sits in shared memory and is read as a broadcast.
#include "common.cuh"

template <int CIN, int COUT, int STRIDE, bool RELU>
__global__ void __launch_bounds__(256) conv3x3(
    const __half* __restrict__ x,  // [N, H, W, CIN]
    const __half* __restrict__ w,  // [3, 3, CIN, COUT]
    const float* __restrict__ b,   // [COUT]
    __half* __restrict__ out,      // [N, Ho, Wo, COUT]
    int N, int H, int W, int Ho, int Wo) {
    constexpr int V = sd::VecWidth<COUT>::value;
    constexpr int GROUPS = COUT / V;
    __shared__ float sw[9 * CIN * COUT];
    for (int i = threadIdx.x; i < 9 * CIN * COUT; i += blockDim.x) sw[i] = __half2float(w[i]);
    __syncthreads();
    const int plane = Ho * Wo, items = N * plane * GROUPS;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int p = i / GROUPS, co = (i - p * GROUPS) * V;
        const int n = p / plane, rem = p - n * plane, oy = rem / Wo, ox = rem - oy * Wo;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = __ldg(b + co + j);
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
            const int iy = oy * STRIDE + ky - 1;
            if (iy < 0 || iy >= H) continue;
#pragma unroll
            for (int kx = 0; kx < 3; ++kx) {
                const int ix = ox * STRIDE + kx - 1;
                if (ix < 0 || ix >= W) continue;
                const __half* px = x + ((n * H + iy) * W + ix) * CIN;
                const float* wk = sw + (ky * 3 + kx) * CIN * COUT + co;
                for (int ci = 0; ci < CIN; ++ci) {
                    const float v = __half2float(px[ci]);
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[j] = fmaf(v, wk[ci * COUT + j], acc[j]);
                }
            }
        }
        if constexpr (RELU) {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = fmaxf(acc[j], 0.0f);
        }
        sd::store_h<V>(out + p * COUT + co, acc);
    }
}
