// output_path: everything the host needs from the logits, in two kernels.
//
// output_stats (one pass over the output pixels, grid [blocks, N]):
//   prob = sigmoid(bilinear2x(logits)) cropped to height x width; mask = 255 * (prob >= thr);
//   entropy_sum[n] += binary entropy of prob (bits); hist[n, v >> 2] += 1 for the input pixel.
// window_score (grid [blocks, N]): the largest mean of prob over kh x kw windows, then the last
//   block of each image (a ticket counter) writes the final score and mean entropy.
// entropy_sum, score_bits, tickets and hist must be zero before output_stats (a memset node in
// the graph): they are accumulated with atomics.
#include "common.cuh"

constexpr int OUT_THREADS = 256;
constexpr float INV_LN2 = 1.4426950408889634f;

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    if (threadIdx.x == 0) {
        for (int i = 0; i < OUT_THREADS / 32; ++i) s += red[i];
    }
    return s;  // valid in thread 0
}

extern "C" __global__ void __launch_bounds__(OUT_THREADS) output_stats(
    const float* __restrict__ logits,         // [N, h, w, 1]
    const unsigned char* __restrict__ images, // [N, height, width]
    float* __restrict__ prob,                 // [N, height, width]
    unsigned char* __restrict__ mask,         // [N, height, width] 0 / 255
    float* __restrict__ entropy_sum,          // [N] bits, summed over pixels
    unsigned int* __restrict__ hist,          // [N, 64]
    int h, int w, int height, int width, float threshold) {
    __shared__ unsigned int sh[64];
    __shared__ float red[OUT_THREADS / 32];
    const int n = blockIdx.y, plane = height * width;
    for (int i = threadIdx.x; i < 64; i += OUT_THREADS) sh[i] = 0u;
    __syncthreads();
    float ent = 0.0f;
    for (int i = blockIdx.x * OUT_THREADS + threadIdx.x; i < plane; i += gridDim.x * OUT_THREADS) {
        const int Y = i / width, X = i - Y * width;
        const float z = sd::bilinear2x_at<float>(logits, h, w, 1, n, Y, X, 0);
        const float p = sd::sigmoid(z);
        const int o = n * plane + i;
        prob[o] = p;
        mask[o] = p >= threshold ? 255 : 0;
        // Binary entropy from the logit, stable at both ends: H = log(1 + e^-|z|) + |z| q,
        // q = e^-|z| / (1 + e^-|z|) (nats).
        const float a = fabsf(z), e = __expf(-a);
        ent += (log1pf(e) + a * (e / (1.0f + e))) * INV_LN2;
        atomicAdd(&sh[images[o] >> 2], 1u);
    }
    const float s = block_sum(ent, red);
    if (threadIdx.x == 0) atomicAdd(entropy_sum + n, s);
    __syncthreads();
    for (int i = threadIdx.x; i < 64; i += OUT_THREADS) {
        if (sh[i]) atomicAdd(hist + n * 64 + i, sh[i]);
    }
}

constexpr int KMAX = 32;

extern "C" __global__ void __launch_bounds__(OUT_THREADS) window_score(
    const float* __restrict__ prob,           // [N, height, width]
    const float* __restrict__ entropy_sum,    // [N]
    unsigned int* __restrict__ score_bits,    // [N] running max window sum (float bits, >= 0)
    unsigned int* __restrict__ tickets,       // [N] finished blocks per image
    float* __restrict__ score,                // [N] final: max window mean, in [0, 1]
    float* __restrict__ entropy,              // [N] final: mean entropy, bits
    int height, int width, int kh, int kw) {  // kh <= height, kw <= width, both <= KMAX
    __shared__ float col[OUT_THREADS + KMAX];
    __shared__ float red[OUT_THREADS / 32];
    __shared__ bool last;
    const int n = blockIdx.y;
    const float* img = prob + (size_t)n * height * width;
    const int rows = height - kh + 1, cols = width - kw + 1;
    const int segs = (cols + OUT_THREADS - 1) / OUT_THREADS;
    float best = 0.0f;
    for (int job = blockIdx.x; job < rows * segs; job += gridDim.x) {
        const int y0 = job / segs, xs = (job - y0 * segs) * OUT_THREADS;
        __syncthreads();  // col of the previous job is consumed
        for (int j = threadIdx.x; j < OUT_THREADS + kw - 1; j += OUT_THREADS) {
            const int x = xs + j;
            float s = 0.0f;
            if (x < width) {
                for (int dy = 0; dy < kh; ++dy) s += img[(y0 + dy) * width + x];
            }
            col[j] = s;
        }
        __syncthreads();
        if (xs + (int)threadIdx.x < cols) {
            float s = 0.0f;
            for (int dx = 0; dx < kw; ++dx) s += col[threadIdx.x + dx];
            best = fmaxf(best, s);
        }
    }
    // Block max, then the image max through the float bits.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int i = 0; i < OUT_THREADS / 32; ++i) m = fmaxf(m, red[i]);
        atomicMax(score_bits + n, __float_as_uint(m));  // non-negative floats order as uints
        __threadfence();
        last = atomicAdd(tickets + n, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        __threadfence();
        const float m = __uint_as_float(atomicAdd(score_bits + n, 0u));
        score[n] = fminf(fmaxf(m / (float)(kh * kw), 0.0f), 1.0f);
        entropy[n] = entropy_sum[n] / (float)(height * width);
    }
}
