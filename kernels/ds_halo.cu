// ds_halo: a stride-1, dilation-1 depthwise-separable block in one persistent kernel whose
// input tiles are staged in shared memory by cp.async, for the high-resolution blocks.
//
// The other paths compute the depthwise stage from device memory: each thread loads the
// 3 x (P + 2) input vectors its P outputs read, so every input byte goes through L1 up to
// ~4.5 times, and the loads of one group are in flight at once at best. ncu had those
// kernels latency- and L1-bound at 12-25 % occupancy. Here a block owns an output tile of
// TH x TW pixels (BM = 128) and, per tile:
//
//   1. waits for the tile's halo (the (TH + 2) x (TW + 2) input pixels it reads, zeros
//      outside the frame; for the decoder join, the (TH/2 + 2) x (TW/2 + 2) low-resolution
//      pixels and the skip's halo), copied by cp.async while the previous tile computed;
//   2. computes relu(dw3x3 + b) of the tile from shared memory into sA [BM][KS] (fp16): one
//      thread per (R x P block of outputs, 4 channels) with the 9 taps' weights in
//      registers, each input vector read once per block (dw_block), the upsampled channels
//      of a join once per source pixel;
//   3. issues the cp.async copies of its next tile's halo, then multiplies sA by the
//      pointwise weight (staged once per block) on the tensor cores: mma_tile.cuh's
//      warp_mma_step over the whole K (one k step, KS = K + 8);
//   4. stages half(acc + bias) over sA and writes whole 16-byte rows (bias, residual, ReLU),
//      or with HEAD reduces each pixel to the 1x1 head's logit; pixels past the frame's
//      right or bottom edge (a partial tile) are computed on zeros and not stored.
//
//   dynamic shared memory
//   ┌──────────────┬────────────────────┬──────────────────┬───────────────────────────────┐
//   │ sDw [9][K]   │ sW [COUT][KS] half │ sA [BM][KS] half │ sX: halo A [AR][AQ][PSA] half │
//   │ half         │ Wᵀ, k contiguous   │ (then sC)        │     halo B [BR][BQ][PSB] half │
//   └──────────────┴────────────────────┴──────────────────┴───────────────────────────────┘
//   A halo pixel is PS halves (its channels, padded to an odd number of 16-byte units, so
//   the reads of consecutive channel groups and pixels spread over the banks).
//
// Numerics are the other paths': taps summed in (ky, kx) order after the bias in fp32 (the
// padding as zeros, like the hoisted schedule), fp16 depthwise output, products summed over
// k in ascending 16-steps, half(acc + bias), then residual and ReLU in fp32; the head's dot
// product in head_logit's order (common.cuh). So the four paths give the same bits.
#include "mma_tile.cuh"

namespace sd {

// Halo pixel stride (halves) of a C-channel plane: an odd number of 16-byte units.
template <int C>
struct HaloPitch {
    static constexpr int value = (C / 8) % 2 == 1 ? C : C + 8;
};

// cp.async the pixels [y0, y0 + R) x [x0, x0 + Q) of frame n of src [N, H, W, C] into
// dst [R * Q][PS], zero-filling those outside the frame.
template <int C, int R, int Q>
__device__ __forceinline__ void stage_halo(
    __half* dst, const __half* __restrict__ src, int n, int H, int W, int y0, int x0) {
    constexpr int CH = C / 8, PS = HaloPitch<C>::value;
    for (int i = threadIdx.x; i < R * Q * CH; i += GEMM_THREADS) {
        const int pix = i / CH, c = (i - pix * CH) * 8;
        const int r = pix / Q, q = pix - r * Q, y = y0 + r, x = x0 + q;
        const bool valid = y >= 0 && y < H && x >= 0 && x < W;
        cp_async16(dst + pix * PS + c, src + (valid ? ((n * H + y) * W + x) * C + c : 0), valid);
    }
}

// 4 halves of shared memory (8 bytes, aligned) <-> 4 floats, exactly / rounded to nearest.
__device__ __forceinline__ void unpack4(uint2 u, float (&f)[4]) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

__device__ __forceinline__ uint2 smem4(const __half* p) { return *reinterpret_cast<const uint2*>(p); }

__device__ __forceinline__ void store4(__half* p, const float (&f)[4]) {
    uint2 u;
    *reinterpret_cast<__half2*>(&u.x) = __floats2half2_rn(f[0], f[1]);
    *reinterpret_cast<__half2*>(&u.y) = __floats2half2_rn(f[2], f[3]);
    *reinterpret_cast<uint2*>(p) = u;
}

// acc[o][q] += b + dw3x3 of an R x P block of outputs (tile rows ty + o, columns tx + q;
// ty a multiple of R, tx of P) for 4 channels: c indexes sDw (and the bias, already in acc),
// ch the halo plane. A thread holds the block's 9 x 4 tap weights in registers and walks the
// R + 2 input rows once: input row r feeds output row o through tap row ky = r - o, column j
// output q through tap kx = j - q. So every output still sums its taps in (ky, kx) order,
// while each input vector and weight is read from shared memory once per block instead of
// once per output row (the stage is bound by shared-memory reads). UP: the join's upsampled
// plane, whose halo is at half resolution: input row r is source row (ty + r + 1) >> 1 and
// column j source column tx/2 + (j + 1) >> 1 (tx even), each source vector loaded once.
template <int P, int R, int K, int Q, int PS, bool UP>
__device__ __forceinline__ void dw_block(
    const __half* halo, const __half* sDw, int ty, int tx, int c, int ch, float (&acc)[R][P][4]) {
    float w[9][4];
#pragma unroll
    for (int t = 0; t < 9; ++t) unpack4(smem4(sDw + t * K + c), w[t]);
    constexpr int NS = UP ? P / 2 + 2 : P + 2;  // loads an input row takes
    uint2 s[NS];
#pragma unroll
    for (int r = 0; r < R + 2; ++r) {
        if constexpr (UP) {
            const int gy = (ty + r + 1) >> 1;  // the source row; a new one every other r
            if (r == 0 || gy != ((ty + r) >> 1)) {
#pragma unroll
                for (int k = 0; k < NS; ++k) s[k] = smem4(halo + (gy * Q + (tx >> 1) + k) * PS + ch);
            }
        } else {
#pragma unroll
            for (int j = 0; j < NS; ++j) s[j] = smem4(halo + ((ty + r) * Q + tx + j) * PS + ch);
        }
#pragma unroll
        for (int j = 0; j < P + 2; ++j) {
            float v[4];
            unpack4(s[UP ? (j + 1) >> 1 : j], v);
#pragma unroll
            for (int o = 0; o < R; ++o) {
                const int ky = r - o;
                if (ky < 0 || ky > 2) continue;
#pragma unroll
                for (int q = 0; q < P; ++q) {
                    const int kx = j - q;
                    if (kx < 0 || kx > 2) continue;
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[o][q][e] = fmaf(v[e], w[ky * 3 + kx][e], acc[o][q][e]);
                }
            }
        }
    }
}

}  // namespace sd

// P x R: a depthwise thread's block of outputs (columns x rows). MINB: blocks an SM must
// hold (the register cap: 2 -> 128 a thread, 3 -> 80).
template <int CA, int CB, int COUT, int TW, int P, int R, bool RES, bool HEAD, int MINB>
__global__ void __launch_bounds__(sd::GEMM_THREADS, MINB) ds_halo(
    const __half* __restrict__ x,     // [N, H, W, CA]; with CB > 0: [N, H/2, W/2, CA]
    const __half* __restrict__ skip,  // [N, H, W, CB] (CB > 0 only)
    const __half* __restrict__ dw_w,  // [3, 3, CA + CB]
    const float* __restrict__ dw_b,   // [CA + CB]
    const __half* __restrict__ wt,    // [COUT, CA + CB]: the pointwise weight, transposed
    const float* __restrict__ bias,   // [COUT]
    const float* __restrict__ head_w, // [COUT] (HEAD only)
    const float* __restrict__ head_b, // [1] (HEAD only)
    void* __restrict__ out,           // [N, H, W, COUT] half; HEAD: [N, H, W, 1] float
    int N, int H, int W) {            // the output's (and the virtual input's) size
    constexpr int K = CA + CB, BM = sd::GEMM_BM, TH = BM / TW, KS = K + 8;
    constexpr int WN = COUT / 2, NT = WN / 8;
    constexpr int AR = CB == 0 ? TH + 2 : TH / 2 + 2, AQ = CB == 0 ? TW + 2 : TW / 2 + 2;
    constexpr int BR = TH + 2, BQ = TW + 2;
    constexpr int PSA = sd::HaloPitch<CA>::value, PSB = CB > 0 ? sd::HaloPitch<CB>::value : 8;
    constexpr int GA = CA / 4, GB = CB / 4, BX = TW / P, BLOCKS = (TH / R) * BX;
    constexpr int ITEMS_A = BLOCKS * GA, ITEMS = BLOCKS * (GA + GB);
    static_assert(CA % 8 == 0 && CB % 8 == 0 && K % 16 == 0, "8-channel groups, k16 steps");
    static_assert(TH % R == 0, "whole row blocks");
    static_assert(COUT % 16 == 0 && COUT <= K, "whole warp columns; sC fits over sA");
    static_assert((KS / 8) % 2 == 1, "odd 16-byte units per row: conflict-free ldmatrix");
    static_assert(BM % TW == 0 && TW % P == 0 && TH % 2 == 0 && P % 2 == 0, "even tiles, blocks");
    static_assert(!RES || (CB == 0 && CA == COUT), "residual needs matching shapes");
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sDw = reinterpret_cast<__half*>(smem);           // [9][K]
    __half* sW = sDw + 9 * K;                                 // [COUT][KS]
    __half* sA = sW + COUT * KS;                              // [BM][KS], then sC [BM][COUT + 8]
    __half* sXa = sA + BM * KS;                               // [AR * AQ][PSA]
    __half* sXb = sXa + AR * AQ * PSA;                        // [BR * BQ][PSB] (CB > 0)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp & 3) * 32, wn = (warp >> 2) * WN;
    const int tiles_x = (W + TW - 1) / TW, tiles_y = (H + TH - 1) / TH;
    const int per_frame = tiles_x * tiles_y, tiles = N * per_frame;

    // The origin (n, oy0, ox0) of tile t: frames, then rows of tiles, then columns.
    auto origin = [&](int t, int& n, int& oy0, int& ox0) {
        n = t / per_frame;
        const int rem = t - n * per_frame, ty = rem / tiles_x;
        oy0 = ty * TH;
        ox0 = (rem - ty * tiles_x) * TW;
    };
    auto stage = [&](int t) {
        if (t < tiles) {
            int n, oy0, ox0;
            origin(t, n, oy0, ox0);
            if constexpr (CB == 0) {
                sd::stage_halo<CA, AR, AQ>(sXa, x, n, H, W, oy0 - 1, ox0 - 1);
            } else {
                sd::stage_halo<CA, AR, AQ>(sXa, x, n, H >> 1, W >> 1, (oy0 >> 1) - 1, (ox0 >> 1) - 1);
                sd::stage_halo<CB, BR, BQ>(sXb, skip, n, H, W, oy0 - 1, ox0 - 1);
            }
        }
        sd::cp_async_commit();
    };

    for (int i = threadIdx.x; i < COUT * (K / 8); i += sd::GEMM_THREADS) {
        const int r = i / (K / 8), c = (i - r * (K / 8)) * 8;
        sd::cp_async16(sW + r * KS + c, wt + r * K + c, true);
    }
    for (int i = threadIdx.x; i < 9 * K / 8; i += sd::GEMM_THREADS) {
        sd::cp_async16(sDw + i * 8, dw_w + i * 8, true);
    }
    stage(blockIdx.x);

    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int n, oy0, ox0;
        origin(t, n, oy0, ox0);
        sd::cp_async_wait<0>();  // this tile's halo (and, the first time, sDw, sW) has landed
        __syncthreads();         // ... everyone's; the previous tile's epilogue is done

        // 2. The depthwise stage: items [0, ITEMS_A) are the A plane's 4-channel groups of
        // each R x P block (whole warps at the shipped widths, so the two kinds rarely share
        // a warp), then B's.
        for (int i = threadIdx.x; i < ITEMS; i += sd::GEMM_THREADS) {
            const bool in_a = i < ITEMS_A;
            const int j = in_a ? i : i - ITEMS_A, groups = in_a ? GA : GB;
            const int blk = j / groups, ch = (j - blk * groups) * 4, c = in_a ? ch : CA + ch;
            const int by = blk / BX, ty = by * R, tx = (blk - by * BX) * P;
            float b[4], acc[R][P][4];
#pragma unroll
            for (int e = 0; e < 4; ++e) b[e] = __ldg(dw_b + c + e);
#pragma unroll
            for (int o = 0; o < R; ++o)
#pragma unroll
                for (int q = 0; q < P; ++q)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[o][q][e] = b[e];
            if (!in_a) {
                sd::dw_block<P, R, K, BQ, PSB, false>(sXb, sDw, ty, tx, c, ch, acc);
            } else {
                sd::dw_block<P, R, K, AQ, PSA, (CB > 0)>(sXa, sDw, ty, tx, c, ch, acc);
            }
#pragma unroll
            for (int o = 0; o < R; ++o)
#pragma unroll
                for (int q = 0; q < P; ++q) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[o][q][e] = fmaxf(acc[o][q][e], 0.0f);
                    sd::store4(sA + ((ty + o) * TW + tx + q) * KS + c, acc[o][q]);
                }
        }
        __syncthreads();  // sA is complete; nobody reads the halo any more

        // 3. The next tile's halo flies while this one multiplies.
        stage(t + gridDim.x);
        float acc[2][NT][4];
        sd::zero_acc(acc);
        sd::warp_mma_step<COUT, K>(sA, sW, acc, wm, wn, lane);
        __syncthreads();  // every warp has read sA: it becomes sC

        // 4. Epilogue.
        constexpr int CS = COUT + 8;
        __half* sC = sA;
        sd::stage_acc<COUT>(sC, acc, bias, wm, wn, lane);
        __syncthreads();
        if constexpr (HEAD) {
            static_assert(sd::GEMM_THREADS == 2 * BM, "two threads per tile row");
            const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
            const int oy = oy0 + r / TW, ox = ox0 + r % TW, p = (n * H + oy) * W + ox;
            const bool valid = oy < H && ox < W;
            const float s = sd::head_logit<COUT, RES>(sC + r * CS, x, p, valid, head_w, part);
            if (valid && part == 0) static_cast<float*>(out)[p] = s + head_b[0];
        } else {
            constexpr int GROUPS = COUT / 8;
            __half* o = static_cast<__half*>(out);
            for (int i = threadIdx.x; i < BM * GROUPS; i += sd::GEMM_THREADS) {
                const int r = i / GROUPS, c = (i - r * GROUPS) * 8;
                const int oy = oy0 + r / TW, ox = ox0 + r % TW;
                if (oy >= H || ox >= W) continue;
                const int p = (n * H + oy) * W + ox;
                sd::finish_vec<8, RES, true>(sC + r * CS + c, x + p * COUT + c, o + p * COUT + c);
            }
        }
    }
    sd::cp_async_wait<0>();  // no copy outlives the block
}
