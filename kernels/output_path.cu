// output_path: everything the host needs from the logits, in two kernels.
//
// output_stats (one pass over the output pixels, grid [blocks, N]):
//   prob = sigmoid(bilinear2x(logits)) cropped to height x width; mask = 255 * (prob >= thr);
//   entropy_sum[n] += binary entropy of prob (bits); hist[n, v >> 2] += 1 for the input pixel.
// window_score (grid [blocks, N]): the largest mean of prob over kh x kw windows (sliding
//   column sums), then the last block of each image (a ticket counter) writes the final
//   score and mean entropy.
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

// Add one pixel's histogram bin to the block's shared histogram.
__device__ __forceinline__ void add_bin(unsigned int* sh, int bin) { atomicAdd(sh + bin, 1u); }

// prob, mask and entropy of output pixel (n, Y, X); returns the entropy (bits).
__device__ __forceinline__ float one_pixel(
    const float* __restrict__ logits, int h, int w, int n, int Y, int X, float threshold,
    float& p, unsigned char& m) {
    const float z = sd::bilinear2x_at<float>(logits, h, w, 1, n, Y, X, 0);
    p = sd::sigmoid(z);
    m = p >= threshold ? 255 : 0;
    // Binary entropy from the logit, stable at both ends: H = log(1 + e^-|z|) + |z| q,
    // q = e^-|z| / (1 + e^-|z|) (nats).
    const float a = fabsf(z), e = __expf(-a);
    return (log1pf(e) + a * (e / (1.0f + e))) * INV_LN2;
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
    if (width % 4 == 0) {
        // Four pixels of a row per thread: 4-byte image/mask and 16-byte prob accesses.
        const int quads = plane / 4;
        for (int i = blockIdx.x * OUT_THREADS + threadIdx.x; i < quads; i += gridDim.x * OUT_THREADS) {
            const int Y = (4 * i) / width, X = 4 * i - Y * width, o = n * plane + 4 * i;
            const uchar4 img = *reinterpret_cast<const uchar4*>(images + o);
            float4 p;
            uchar4 m;
            ent += one_pixel(logits, h, w, n, Y, X, threshold, p.x, m.x);
            ent += one_pixel(logits, h, w, n, Y, X + 1, threshold, p.y, m.y);
            ent += one_pixel(logits, h, w, n, Y, X + 2, threshold, p.z, m.z);
            ent += one_pixel(logits, h, w, n, Y, X + 3, threshold, p.w, m.w);
            *reinterpret_cast<float4*>(prob + o) = p;
            *reinterpret_cast<uchar4*>(mask + o) = m;
            add_bin(sh, img.x >> 2);
            add_bin(sh, img.y >> 2);
            add_bin(sh, img.z >> 2);
            add_bin(sh, img.w >> 2);
        }
    } else {
        for (int i = blockIdx.x * OUT_THREADS + threadIdx.x; i < plane; i += gridDim.x * OUT_THREADS) {
            const int Y = i / width, X = i - Y * width, o = n * plane + i;
            ent += one_pixel(logits, h, w, n, Y, X, threshold, prob[o], mask[o]);
            add_bin(sh, images[o] >> 2);
        }
    }
    const float s = block_sum(ent, red);
    if (threadIdx.x == 0) atomicAdd(entropy_sum + n, s);
    __syncthreads();
    for (int i = threadIdx.x; i < 64; i += OUT_THREADS) {
        if (sh[i]) atomicAdd(hist + n * 64 + i, sh[i]);
    }
}

constexpr int KMAX = 32;

// Each job is a band of up to `band` window rows by 256 window columns. A thread keeps the
// vertical kh-sum of its column(s) and slides it down the band (add the row entering, drop
// the row leaving: two loads a row instead of kh); the horizontal kw-sum comes from the
// row of column sums in shared memory.
extern "C" __global__ void __launch_bounds__(OUT_THREADS) window_score(
    const float* __restrict__ prob,           // [N, height, width]
    const float* __restrict__ entropy_sum,    // [N]
    unsigned int* __restrict__ score_bits,    // [N] running max window sum (float bits, >= 0)
    unsigned int* __restrict__ tickets,       // [N] finished blocks per image
    float* __restrict__ score,                // [N] final: max window mean, in [0, 1]
    float* __restrict__ entropy,              // [N] final: mean entropy, bits
    int height, int width, int kh, int kw,    // kh <= height, kw <= width, both <= KMAX
    int band) {                               // window rows per job
    __shared__ float col[OUT_THREADS + KMAX];
    __shared__ float red[OUT_THREADS / 32];
    __shared__ bool last;
    const int n = blockIdx.y, t = threadIdx.x;
    const float* img = prob + (size_t)n * height * width;
    const int rows = height - kh + 1, cols = width - kw + 1;
    const int segs = (cols + OUT_THREADS - 1) / OUT_THREADS, bands = (rows + band - 1) / band;
    float best = 0.0f;
    for (int job = blockIdx.x; job < bands * segs; job += gridDim.x) {
        const int y0 = (job / segs) * band, xs = (job % segs) * OUT_THREADS;
        const int y1 = min(y0 + band, rows);
        const int xa = xs + t, xb = xs + t + OUT_THREADS;  // this thread's columns
        const bool has_a = xa < width, has_b = t < kw - 1 && xb < width;
        float sa = 0.0f, sb = 0.0f;
        for (int dy = 0; dy < kh; ++dy) {
            if (has_a) sa += img[(y0 + dy) * width + xa];
            if (has_b) sb += img[(y0 + dy) * width + xb];
        }
        for (int y = y0; y < y1; ++y) {
            __syncthreads();  // the previous row of column sums is consumed
            col[t] = sa;
            if (t < kw - 1) col[t + OUT_THREADS] = sb;
            __syncthreads();
            if (xs + t < cols) {
                float s = 0.0f;
                for (int dx = 0; dx < kw; ++dx) s += col[t + dx];
                best = fmaxf(best, s);
            }
            if (y + 1 < y1) {
                if (has_a) sa += img[(y + kh) * width + xa] - img[y * width + xa];
                if (has_b) sb += img[(y + kh) * width + xb] - img[y * width + xb];
            }
        }
    }
    // Block max, then the image max through the float bits.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
    if ((t & 31) == 0) red[t >> 5] = best;
    __syncthreads();
    if (t == 0) {
        float m = 0.0f;
        for (int i = 0; i < OUT_THREADS / 32; ++i) m = fmaxf(m, red[i]);
        atomicMax(score_bits + n, __float_as_uint(m));  // non-negative floats order as uints
        __threadfence();
        last = atomicAdd(tickets + n, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && t == 0) {
        __threadfence();
        const float m = __uint_as_float(atomicAdd(score_bits + n, 0u));
        score[n] = fminf(fmaxf(m / (float)(kh * kw), 0.0f), 1.0f);
        entropy[n] = entropy_sum[n] / (float)(height * width);
    }
}
