// dwconv3x3: depthwise 3x3 convolution (zero padding = DIL), stride, bias, activation.
// One thread per (output pixel, group of V channels); consecutive threads take consecutive
// channel groups of a pixel, so the 16-byte loads of a warp are contiguous.
#include "common.cuh"

template <int C, int STRIDE, int DIL, bool RELU>
__global__ void __launch_bounds__(256) dwconv3x3(
    const __half* __restrict__ x,  // [N, H, W, C]
    const __half* __restrict__ w,  // [3, 3, C]
    const float* __restrict__ b,   // [C]
    __half* __restrict__ out,      // [N, Ho, Wo, C]
    int N, int H, int W, int Ho, int Wo) {
    constexpr int V = sd::VecWidth<C>::value;
    constexpr int GROUPS = C / V;
    const sd::DwSource<C, 0> src{x, nullptr, H, W};
    const int plane = Ho * Wo, items = N * plane * GROUPS;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int p = i / GROUPS, c = (i - p * GROUPS) * V;
        const int n = p / plane, rem = p - n * plane, oy = rem / Wo, ox = rem - oy * Wo;
        float acc[V];
        sd::dw_point<V, STRIDE, DIL, RELU>(src, w, b, n, oy, ox, c, acc);
        sd::store_h<V>(out + p * C + c, acc);
    }
}
