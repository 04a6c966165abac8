// row_runs: the horizontal runs of prob >= threshold of every frame, compacted per frame in
// row-major order (the reference's order), in two kernels over the map:
//
// row_run_counts (grid [ceil(H / 8), N], 256 threads: one warp per row): the number of runs
//   of each row -> row_count[n, y]; count[n] += it (atomics, count zero before the launch).
// row_runs (same grid): each warp sums row_count[n, 0:y] (its record offset; integer sums,
//   exact), walks its row 32 pixels at a time and writes each run's record at the next
//   offset:  runs[n, k] = (row, start, end, float bits of the run's prob sum)
//   Records k >= cap are not written; count[n] > cap tells the host the frame overflowed
//   (the stored ones are then its first cap runs, row-major).
//
// A ballot of the thresholded chunk gives the foreground bits, identical in every lane, so
// the run state (open, start, sum) is warp-uniform. Each maximal segment of set bits adds
// the warp sum of its pixels to the open run; a run closes at the first clear bit (or at
// the row's end).

constexpr unsigned FULL = 0xffffffffu;
constexpr int RUN_THREADS = 256;

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (each step adds commuting pairs)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(RUN_THREADS) row_run_counts(
    const float* __restrict__ prob,  // [N, H, W]
    int* __restrict__ row_count,     // [N, H] runs of each row
    int* __restrict__ count,         // [N] runs of each frame (zero before: atomics)
    int height, int width, float threshold) {
    const int lane = threadIdx.x & 31, n = blockIdx.y;
    const int y = blockIdx.x * (RUN_THREADS / 32) + (threadIdx.x >> 5);
    if (y >= height) return;  // the whole warp leaves; nothing below syncs the block
    const float* row = prob + ((size_t)n * height + y) * width;
    int runs = 0;
    unsigned carry = 0u;  // 1 when the previous chunk's last pixel is foreground
    for (int c0 = 0; c0 < width; c0 += 32) {
        const int x = c0 + lane;
        const unsigned bits = __ballot_sync(FULL, x < width && row[x] >= threshold);
        runs += __popc(bits & ~((bits << 1) | carry));  // set bits whose left neighbour is clear
        carry = bits >> 31;
    }
    if (lane == 0) {
        row_count[(size_t)n * height + y] = runs;
        if (runs) atomicAdd(count + n, runs);
    }
}

extern "C" __global__ void __launch_bounds__(RUN_THREADS) row_runs(
    const float* __restrict__ prob,      // [N, H, W]
    const int* __restrict__ row_count,   // [N, H] from row_run_counts
    int4* __restrict__ runs,             // [N, cap] records (row, start, end, sum bits)
    int height, int width, int cap, float threshold) {
    const int lane = threadIdx.x & 31, n = blockIdx.y;
    const int y = blockIdx.x * (RUN_THREADS / 32) + (threadIdx.x >> 5);
    if (y >= height) return;
    const int* counts = row_count + (size_t)n * height;
    if (counts[y] == 0) return;
    int before = 0;
    for (int r = lane; r < y; r += 32) before += counts[r];
    int k = warp_sum_int(before);  // this row's first record
    if (k >= cap) return;
    const float* row = prob + ((size_t)n * height + y) * width;
    int4* out = runs + (size_t)n * cap;
    bool open = false;
    int start = 0;
    float sum = 0.0f;
    for (int c0 = 0; c0 < width && k < cap; c0 += 32) {
        const int x = c0 + lane;
        const float p = x < width ? row[x] : 0.0f;
        unsigned bits = __ballot_sync(FULL, x < width && p >= threshold);
        if (open && !(bits & 1u)) {  // the open run ended with the previous chunk
            if (lane == 0) out[k] = make_int4(y, start, c0, __float_as_int(sum));
            ++k;
            open = false;
        }
        while (bits) {
            const int s = __ffs(bits) - 1;
            const unsigned clear = ~bits & (FULL << s);  // clear bits from s on
            const int e = clear ? __ffs(clear) - 1 : 32;  // one past the segment
            const unsigned seg = (e == 32 ? FULL : (1u << e) - 1u) & (FULL << s);
            const float part = warp_sum((seg >> lane) & 1u ? p : 0.0f);
            if (!open) {
                start = c0 + s;
                sum = 0.0f;
                open = true;
            }
            sum += part;
            if (e < 32) {
                if (lane == 0 && k < cap) out[k] = make_int4(y, start, c0 + e, __float_as_int(sum));
                ++k;
                open = false;
            }
            bits &= ~seg;
        }
    }
    if (open && k < cap && lane == 0) out[k] = make_int4(y, start, width, __float_as_int(sum));
}
