// normalize_pad: uint8 frames → (x/255 - mean)/std as fp16, edge-replicated bottom/right to
// [Hp, Wp]. One thread per output pixel; the clamp-to-edge read is the padding.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) normalize_pad(
    const unsigned char* __restrict__ images,  // [N, H, W]
    __half* __restrict__ out,                  // [N, Hp, Wp, 1]
    int N, int H, int W, int Hp, int Wp,
    float scale,                               // 1 / (255 * std)
    float shift) {                             // -mean / std
    const int plane = Hp * Wp, items = N * plane;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int n = i / plane, rem = i - n * plane, y = rem / Wp, x = rem - y * Wp;
        const int sy = min(y, H - 1), sx = min(x, W - 1);
        const float v = (float)images[(n * H + sy) * W + sx];
        out[i] = __float2half_rn(fmaf(v, scale, shift));
    }
}
