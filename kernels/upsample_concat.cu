// upsample_concat: out = concat(nearest_upsample2x(x), skip) along channels (the decoder
// join as a standalone op; the network itself fuses it into ds_block's depthwise read).
#include "common.cuh"

template <int C1, int C2>
__global__ void __launch_bounds__(256) upsample_concat(
    const __half* __restrict__ x,     // [N, h, w, C1]
    const __half* __restrict__ skip,  // [N, 2h, 2w, C2]
    __half* __restrict__ out,         // [N, 2h, 2w, C1 + C2]
    int N, int H, int W) {            // H = 2h, W = 2w
    constexpr int V = (C1 % 8 == 0 && C2 % 8 == 0) ? 8 : 1;
    constexpr int C = C1 + C2, GROUPS = C / V;
    const sd::DwSource<C1, C2> src{x, skip, H, W};
    const int plane = H * W, items = N * plane * GROUPS;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int p = i / GROUPS, c = (i - p * GROUPS) * V;
        const int n = p / plane, rem = p - n * plane, y = rem / W, xx = rem - y * W;
        float v[V];
        sd::load_h<V>(src.at(n, y, xx, c), v);
        sd::store_h<V>(out + p * C + c, v);
    }
}
