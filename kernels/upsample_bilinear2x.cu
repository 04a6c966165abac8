// upsample_bilinear2x: bilinear 2x upsampling of an NHWC tensor (fp16 or fp32), one thread
// per output element (see sd::bilinear2x_at for the weights).
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(256) upsample_bilinear2x(
    const T* __restrict__ x,  // [N, h, w, C]
    T* __restrict__ out,      // [N, 2h, 2w, C]
    int N, int h, int w, int C) {
    const int H = 2 * h, W = 2 * w, items = N * H * W * C;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int p = i / C, c = i - p * C;
        const int n = p / (H * W), rem = p - n * H * W, Y = rem / W, X = rem - Y * W;
        out[i] = sd::from_float<T>(sd::bilinear2x_at<T>(x, h, w, C, n, Y, X, c));
    }
}
