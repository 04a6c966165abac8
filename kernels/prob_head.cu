// prob_head: logits at half resolution → bilinear 2x, crop to height x width, sigmoid.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) prob_head(
    const float* __restrict__ logits,  // [N, h, w, 1]
    float* __restrict__ prob,          // [N, height, width]
    int N, int h, int w, int height, int width) {
    const int plane = height * width, items = N * plane;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int n = i / plane, rem = i - n * plane, Y = rem / width, X = rem - Y * width;
        prob[i] = sd::sigmoid(sd::bilinear2x_at<float>(logits, h, w, 1, n, Y, X, 0));
    }
}
