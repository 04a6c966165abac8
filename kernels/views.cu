// Test-time views on the device: view_stack (frames → the view frames the forward runs) and
// view_mean (the views' probability maps mapped back, averaged, and their entropy summed).
//
// A view slot word (views.py: view_layout, ViewLayout.words) says where view j of frame i lives:
//   code = word & 3        0 identity, 1 flip_h (columns reversed), 2 flip_v (rows reversed),
//                          3 transpose
//   buf  = (word >> 2) & 1 0: buffer A [VA * N, H, W], 1: buffer B [N, W, H] (the transpose
//                          of a non-square frame)
//   slot = word >> 3       view frame (slot * N + i) of its buffer
// Both kernels work on 32 x 32 tiles (grid [ceil(W/32), ceil(H/32), N], block 32 x 8) so the
// transposed view is read and written through shared memory, coalesced on both sides.

constexpr int TILE = 32;
constexpr int ROWS = 8;  // threadIdx.y extent: each thread covers TILE / ROWS rows
constexpr int MAX_VIEWS = 4;

__device__ __forceinline__ int view_code(int word) { return word & 3; }

__device__ __forceinline__ size_t view_frame(int word, int n, int i) {
    return (size_t)(word >> 3) * n + i;
}

extern "C" __global__ void __launch_bounds__(TILE * ROWS) view_stack(
    const unsigned char* __restrict__ frames,  // [N, H, W]
    unsigned char* __restrict__ a,             // [VA * N, H, W]
    unsigned char* __restrict__ b,             // [N, W, H] (unused when no slot names B)
    int n, int height, int width, int nviews,
    int w0, int w1, int w2, int w3) {          // view slot words, model order
    __shared__ unsigned char tile[TILE][TILE + 1];
    const int i = blockIdx.z, x0 = blockIdx.x * TILE, y0 = blockIdx.y * TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const size_t plane = (size_t)height * width;
    const unsigned char* src = frames + i * plane;
    for (int r = ty; r < TILE; r += ROWS) {
        const int y = y0 + r, x = x0 + tx;
        if (y < height && x < width) tile[r][tx] = src[(size_t)y * width + x];
    }
    __syncthreads();
    const int words[MAX_VIEWS] = {w0, w1, w2, w3};
    for (int j = 0; j < nviews; ++j) {
        const int code = view_code(words[j]);
        unsigned char* dst = ((words[j] >> 2) & 1 ? b : a) + view_frame(words[j], n, i) * plane;
        if (code == 3) {
            // dst is [W, H]: dst[x][y] = frame[y][x]; threadIdx.x walks y (coalesced writes).
            for (int r = ty; r < TILE; r += ROWS) {
                const int x = x0 + r, y = y0 + tx;
                if (x < width && y < height) dst[(size_t)x * height + y] = tile[tx][r];
            }
        } else {
            for (int r = ty; r < TILE; r += ROWS) {
                const int y = y0 + r, x = x0 + tx;
                if (y >= height || x >= width) continue;
                const int dy = code == 2 ? height - 1 - y : y;
                const int dx = code == 1 ? width - 1 - x : x;
                dst[(size_t)dy * width + dx] = tile[r][tx];
            }
        }
    }
}

// Binary entropy in bits; 0 at p = 0 and p = 1.
__device__ __forceinline__ float entropy_bits(float p) {
    const float q = 1.0f - p;
    float h = 0.0f;
    if (p > 0.0f) h -= p * log2f(p);
    if (q > 0.0f) h -= q * log2f(q);
    return h;
}

extern "C" __global__ void __launch_bounds__(TILE * ROWS) view_mean(
    const float* __restrict__ a,       // [VA * N, H, W] probability of the views in A
    const float* __restrict__ b,       // [N, W, H] probability of the transposed view
    float* __restrict__ mean,          // [N, H, W] views mapped back, summed in view order / V
    float* __restrict__ entropy_sum,   // [N] bits summed over pixels (zero before: atomics)
    int n, int height, int width, int nviews,
    int w0, int w1, int w2, int w3) {
    __shared__ float tile[TILE][TILE + 1];
    __shared__ float red[TILE * ROWS / 32];
    const int i = blockIdx.z, x0 = blockIdx.x * TILE, y0 = blockIdx.y * TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const size_t plane = (size_t)height * width;
    const int words[MAX_VIEWS] = {w0, w1, w2, w3};
    float acc[TILE / ROWS];
#pragma unroll
    for (int k = 0; k < TILE / ROWS; ++k) acc[k] = 0.0f;
    for (int j = 0; j < nviews; ++j) {  // view order: the reference's order of summation
        const int code = view_code(words[j]);
        const float* src = ((words[j] >> 2) & 1 ? b : a) + view_frame(words[j], n, i) * plane;
        if (code == 3) {
            // src is [W, H]: mean[y][x] takes src[x][y]; read rows of src into the tile.
            __syncthreads();  // the previous transposed tile is consumed
            for (int r = ty; r < TILE; r += ROWS) {
                const int x = x0 + r, y = y0 + tx;
                tile[r][tx] = (x < width && y < height) ? src[(size_t)x * height + y] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < TILE / ROWS; ++k) acc[k] += tile[tx][ty + k * ROWS];
        } else {
#pragma unroll
            for (int k = 0; k < TILE / ROWS; ++k) {
                const int y = y0 + ty + k * ROWS, x = x0 + tx;
                if (y >= height || x >= width) continue;
                const int sy = code == 2 ? height - 1 - y : y;
                const int sx = code == 1 ? width - 1 - x : x;
                acc[k] += src[(size_t)sy * width + sx];
            }
        }
    }
    float ent = 0.0f;
#pragma unroll
    for (int k = 0; k < TILE / ROWS; ++k) {
        const int y = y0 + ty + k * ROWS, x = x0 + tx;
        if (y >= height || x >= width) continue;
        const float m = acc[k] / (float)nviews;
        mean[i * plane + (size_t)y * width + x] = m;
        ent += entropy_bits(m);
    }
    // Block sum of the entropy, one atomic per block.
    const int t = ty * TILE + tx;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ent += __shfl_xor_sync(0xffffffffu, ent, o);
    if ((t & 31) == 0) red[t >> 5] = ent;
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (int k = 0; k < TILE * ROWS / 32; ++k) s += red[k];
        atomicAdd(entropy_sum + i, s);
    }
}
