// row_runs: the horizontal runs of prob >= threshold of every frame, compacted per frame.
//
// One warp per row (grid [ceil(H / 8), N], 256 threads). The warp walks its row 32 pixels at
// a time; a ballot of the thresholded chunk gives the foreground bits, identical in every
// lane, so the run state (open, start, sum) is warp-uniform. Each maximal segment of set
// bits adds the warp sum of its pixels to the open run; a run closes at the first clear bit
// (or the row's end) and lane 0 appends it to its frame's list through an atomic counter:
//   runs[n, k] = (row, start, end, float bits of the run's prob sum), k = count[n]++
// Records k >= cap are not written, but count[n] keeps counting: count[n] > cap tells the
// host the frame overflowed. Order within a frame follows the atomics (the host sorts).
// count must be zero before the launch (a memset node in the graph).

constexpr unsigned FULL = 0xffffffffu;
constexpr int RUN_THREADS = 256;

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (each step adds commuting pairs)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ void emit_run(
    int4* __restrict__ runs, int* __restrict__ count, int n, int cap, int lane, int y,
    int start, int end, float sum) {
    if (lane != 0) return;
    const int k = atomicAdd(count + n, 1);
    if (k < cap) runs[(size_t)n * cap + k] = make_int4(y, start, end, __float_as_int(sum));
}

extern "C" __global__ void __launch_bounds__(RUN_THREADS) row_runs(
    const float* __restrict__ prob,  // [N, H, W]
    int4* __restrict__ runs,         // [N, cap] records (row, start, end, sum bits)
    int* __restrict__ count,         // [N] runs found (> cap: overflowed)
    int height, int width, int cap, float threshold) {
    const int lane = threadIdx.x & 31, n = blockIdx.y;
    const int y = blockIdx.x * (RUN_THREADS / 32) + (threadIdx.x >> 5);
    if (y >= height) return;  // the whole warp leaves; nothing below syncs the block
    const float* row = prob + ((size_t)n * height + y) * width;
    bool open = false;
    int start = 0;
    float sum = 0.0f;
    for (int c0 = 0; c0 < width; c0 += 32) {
        const int x = c0 + lane;
        const float p = x < width ? row[x] : 0.0f;
        unsigned bits = __ballot_sync(FULL, x < width && p >= threshold);
        if (open && !(bits & 1u)) {  // the open run ended with the previous chunk
            emit_run(runs, count, n, cap, lane, y, start, c0, sum);
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
                emit_run(runs, count, n, cap, lane, y, start, c0 + e, sum);
                open = false;
            }
            bits &= ~seg;
        }
    }
    if (open) emit_run(runs, count, n, cap, lane, y, start, width, sum);
}
