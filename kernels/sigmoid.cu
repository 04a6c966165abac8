// sigmoid: elementwise logistic function in fp32, overflow-free for any input.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) sigmoid(
    const float* __restrict__ x,  // [size] (any shape, flattened)
    float* __restrict__ out,      // [size]
    int size) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < size; i += gridDim.x * blockDim.x) {
        out[i] = sd::sigmoid(x[i]);
    }
}
