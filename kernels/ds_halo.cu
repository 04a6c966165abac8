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
//      thread per (P pixels of a tile row, 8 channels), the upsampled channels of a join
//      loaded once per source pixel (as dw_group.cuh's up_rows);
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
//   A halo pixel is PS halves (its channels, padded to an odd number of 16-byte units, so the
//   16-byte reads of consecutive channel groups and pixels spread over the banks).
//
// Numerics are the other paths': taps summed in (ky, kx) order after the bias in fp32 (the
// padding as zeros, like the hoisted schedule), fp16 depthwise output, products summed over
// k in ascending 16-steps, half(acc + bias), then residual and ReLU in fp32; the head's dot
// product in store_tile_head's order. So the four paths give the same bits.
#include "dw_group.cuh"
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

__device__ __forceinline__ RawH<8> smem_raw(const __half* p) {
    return RawH<8>{*reinterpret_cast<const uint4*>(p)};
}

// acc[q] += the taps of input row `row` (P + 2 raw vectors, the group's columns) for tap row
// ky: column j feeds output q through tap kx = j - q. The weights stay fp16 in shared memory
// (half the bytes of fp32: the depthwise stage is bound by shared-memory reads) and widen
// exactly when loaded.
template <int P, int K>
__device__ __forceinline__ void add_row(
    const RawH<8> (&raw)[P + 2], const __half* sDw, int ky, int c, float (&acc)[P][8]) {
    float w[3][8];
#pragma unroll
    for (int kx = 0; kx < 3; ++kx) load_h_smem<8>(sDw + (ky * 3 + kx) * K + c, w[kx]);
#pragma unroll
    for (int j = 0; j < P + 2; ++j) {
        float v[8];
        unpack<8>(raw[j], v);
        add_column<8, P, 1, 1>(j, v, w, acc);
    }
}

// relu(b + dw3x3) of P pixels (tile row ty, columns tx..tx+P-1) for channels [c, c + 8) of a
// plane at the tile's own resolution: halo rows ty..ty+2, columns tx..tx+P+1.
template <int P, int K, int Q, int PS>
__device__ __forceinline__ void dw_full(
    const __half* halo, const __half* sDw, int ty, int tx, int c, int ch, float (&acc)[P][8]) {
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
        RawH<8> raw[P + 2];
#pragma unroll
        for (int j = 0; j < P + 2; ++j) raw[j] = smem_raw(halo + ((ty + ky) * Q + tx + j) * PS + ch);
        add_row<P, K>(raw, sDw, ky, c, acc);
    }
}

// The same for the join's upsampled plane, whose halo is at half resolution: virtual halo
// row ty + ky is source row (ty + ky + 1) >> 1 and virtual column tx + j source column
// (tx + j + 1) >> 1 (tile origins are even), so the 3 x (P + 2) virtual vectors come from
// 2 x (P/2 + 2) loads (ky 1 reads the first source row when ty is odd, else the second).
template <int P, int K, int Q, int PS>
__device__ __forceinline__ void dw_up(
    const __half* halo, const __half* sDw, int ty, int tx, int c, float (&acc)[P][8]) {
    constexpr int NS = P / 2 + 2;
    const int s0 = (ty + 1) >> 1, x0 = tx >> 1;
    RawH<8> s[2][NS];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < NS; ++k) s[r][k] = smem_raw(halo + ((s0 + r) * Q + x0 + k) * PS + c);
    const bool odd = ty & 1;
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
        RawH<8> raw[P + 2];
#pragma unroll
        for (int j = 0; j < P + 2; ++j) {
            const int k = (j + 1) >> 1;
            raw[j] = ky == 0 ? s[0][k] : ky == 2 ? s[1][k] : (odd ? s[0][k] : s[1][k]);
        }
        add_row<P, K>(raw, sDw, ky, c, acc);
    }
}

}  // namespace sd

// MINB: blocks an SM must hold (the register cap: 2 -> 128 a thread, 3 -> 80).
template <int CA, int CB, int COUT, int TW, int P, bool RES, bool HEAD, int MINB>
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
    constexpr int GA = CA / 8, GB = CB / 8, ITEMS_A = (BM / P) * GA, ITEMS = (BM / P) * (GA + GB);
    static_assert(CA % 8 == 0 && CB % 8 == 0 && K % 16 == 0, "8-channel groups, k16 steps");
    static_assert(COUT % 16 == 0 && COUT <= K, "whole warp columns; sC fits over sA");
    static_assert((KS / 8) % 2 == 1, "odd 16-byte units per row: conflict-free ldmatrix");
    static_assert(BM % TW == 0 && TW % P == 0 && TH % 2 == 0 && P % 2 == 0, "even tiles, groups");
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

        // 2. The depthwise stage: items [0, ITEMS_A) are the A plane's channel groups (whole
        // warps at the shipped widths, so the two kinds rarely share a warp), then B's.
        for (int i = threadIdx.x; i < ITEMS; i += sd::GEMM_THREADS) {
            const bool in_a = i < ITEMS_A;
            const int j = in_a ? i : i - ITEMS_A, groups = in_a ? GA : GB;
            const int g = j / groups, ch = (j - g * groups) * 8, c = in_a ? ch : CA + ch;
            const int r0 = g * P, ty = r0 / TW, tx = r0 - ty * TW;
            float b[8], acc[P][8];
#pragma unroll
            for (int e = 0; e < 8; ++e) b[e] = __ldg(dw_b + c + e);
#pragma unroll
            for (int q = 0; q < P; ++q)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[q][e] = b[e];
            if (!in_a) {
                sd::dw_full<P, K, BQ, PSB>(sXb, sDw, ty, tx, c, ch, acc);
            } else if constexpr (CB > 0) {
                sd::dw_up<P, K, AQ, PSA>(sXa, sDw, ty, tx, c, acc);
            } else {
                sd::dw_full<P, K, AQ, PSA>(sXa, sDw, ty, tx, c, ch, acc);
            }
#pragma unroll
            for (int q = 0; q < P; ++q) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[q][e] = fmaxf(acc[q][e], 0.0f);
                sd::store_h<8>(sA + (r0 + q) * KS + c, acc[q]);
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
            // Two threads per row, each summing half the channels, joined with a shuffle (the
            // order of pw_tile.cuh's store_tile_head, so the logits are the same bits).
            static_assert(sd::GEMM_THREADS == 2 * BM, "two threads per tile row");
            constexpr int HALF = (COUT + 1) / 2;
            const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
            const int oy = oy0 + r / TW, ox = ox0 + r % TW, p = (n * H + oy) * W + ox;
            const bool valid = oy < H && ox < W;
            float s = 0.0f;
#pragma unroll 4
            for (int j = 0; j < HALF; ++j) {
                const int c = part * HALF + j;
                if (c >= COUT) break;
                float v = __half2float(sC[r * CS + c]);
                if constexpr (RES) v += valid ? __half2float(x[p * COUT + c]) : 0.0f;
                v = fmaxf(v, 0.0f);
                s = fmaf(v, __ldg(head_w + c), s);
            }
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            if (valid && part == 0) static_cast<float*>(out)[p] = s + head_b[0];
        } else {
            constexpr int GROUPS = COUT / 8;
            __half* o = static_cast<__half*>(out);
            for (int i = threadIdx.x; i < BM * GROUPS; i += sd::GEMM_THREADS) {
                const int r = i / GROUPS, c = (i - r * GROUPS) * 8;
                const int oy = oy0 + r / TW, ox = ox0 + r % TW;
                if (oy >= H || ox >= W) continue;
                const int p = (n * H + oy) * W + ox;
                float v[8];
                sd::load_h_smem<8>(sC + r * CS + c, v);
                if constexpr (RES) {
                    float rv[8];
                    sd::load_h<8>(x + p * COUT + c, rv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] += rv[e];
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = fmaxf(v[e], 0.0f);
                sd::store_h<8>(o + p * COUT + c, v);
            }
        }
    }
    sd::cp_async_wait<0>();  // no copy outlives the block
}
