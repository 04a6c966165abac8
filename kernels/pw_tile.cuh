// The pointwise (1x1) tensor-core GEMM tile shared by pwconv.cu and ds_block.cu.
//
// A block owns BM = 64 consecutive output pixels (flattened n, y, x) at a time and loops over
// such tiles (persistent grid), so the weight is staged into shared memory once per block:
//
//   shared memory (halves)
//   ┌──────────────────────────────┬────────────────────────────────────────────┐
//   │ sW [NP][KS]  W transposed,   │ sA [BM][KS]  the A operand (pixels x Cin)   │
//   │ zero beyond Cout / Cin       │ then, reused, sC [BM][CS] (acc + bias, fp16) │
//   └──────────────────────────────┴────────────────────────────────────────────┘
//   KP = Cin rounded up to 16 (the mma K step), KS = KP + 8 (row stride: 4 mod 8 words, so
//   the 8 rows a fragment load touches fall in distinct banks); NP = Cout rounded up to 8;
//   CS = NP + 8 or + 16, whichever is 8 mod 16.
//
// Wide layers are split over blockIdx.y into slices of the output channels (the host picks
// the fewest slices whose tile fits in shared memory): each block stages only its slice of
// W and writes only its slice of out; the A operand (and its depthwise work) is recomputed
// per slice.
//
// Per tile: (1) produce A (MODE 0: copy the input rows; MODE 1: depthwise 3x3 + bias + ReLU
// computed here, so its output never reaches device memory), (2) each of the 4 warps
// multiplies 16 rows of A by all of W with mma.sync m16n8k16 (fp32 accumulators),
// (3) acc + bias is staged in sC, (4) the epilogue adds the residual, applies the ReLU and
// writes 16-byte rows (or, with HEAD, reduces each pixel to the head's one logit).
#pragma once
#include "common.cuh"

namespace sd {

constexpr int PW_BM = 64;
constexpr int PW_THREADS = 128;

template <int CIN, int COUT>
struct PwShape {
    static constexpr int KP = (CIN + 15) / 16 * 16;
    static constexpr int KS = KP + 8;
    static constexpr int NP = (COUT + 7) / 8 * 8;
    static constexpr int NT = NP / 8;
    // sC row stride: 8 mod 16 halves, like KS, so the staging writes and the epilogue's
    // row reads spread over the banks.
    static constexpr int CS = (NP + 8) % 16 == 0 ? NP + 16 : NP + 8;
    static constexpr int AREA = (KS > CS ? KS : CS) * PW_BM;
    static constexpr int SMEM_BYTES = (NP * KS + AREA) * 2;
};

// Stage W ([CIN, COUT], fp16, global) transposed and zero-padded into sW[NP][KS]: zero the
// whole tile, then scatter W in. With COUT % 8 == 0 each thread reads 8 output channels of
// one input channel as a 16-byte vector and consecutive threads take consecutive input
// channels, so the eight 2-byte shared stores of a warp land in consecutive words (no bank
// conflicts; the opposite order put all 32 lanes of a store in one bank).
template <int CIN, int COUT>
__device__ __forceinline__ void stage_weight(
    const __half* __restrict__ w,  // [CIN, ldw]: this block's slice is columns [n0, n0 + COUT)
    __half* sW, int ldw, int n0) {
    using S = PwShape<CIN, COUT>;
    constexpr int V = VecWidth<COUT>::value;
    static_assert((S::NP * S::KS) % 8 == 0, "sW is a whole number of 16-byte vectors");
    for (int i = threadIdx.x; i < S::NP * S::KS / 8; i += PW_THREADS) {
        reinterpret_cast<uint4*>(sW)[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    __syncthreads();
#pragma unroll 4
    for (int i = threadIdx.x; i < CIN * COUT / V; i += PW_THREADS) {
        const int n = (i / CIN) * V, k = i - (i / CIN) * CIN;
        if constexpr (V == 8) {
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(w + k * ldw + n0 + n));
            const __half* h = reinterpret_cast<const __half*>(&u);
#pragma unroll
            for (int j = 0; j < 8; ++j) sW[(n + j) * S::KS + k] = h[j];
        } else {
            sW[n * S::KS + k] = w[k * ldw + n0 + n];
        }
    }
}

// (2) + (3): sC = A @ W + bias (rounded to fp16). Ends with sC complete (synchronised).
template <int CIN, int COUT>
__device__ __forceinline__ void gemm_tile(const __half* sW, __half* sA, const float* __restrict__ bias) {
    using S = PwShape<CIN, COUT>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float acc[S::NT][4];
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    const __half* a_row = sA + (warp * 16 + g) * S::KS + 2 * t;
#pragma unroll
    for (int k0 = 0; k0 < S::KP; k0 += 16) {
        unsigned a[4];
        a[0] = *reinterpret_cast<const unsigned*>(a_row + k0);
        a[1] = *reinterpret_cast<const unsigned*>(a_row + 8 * S::KS + k0);
        a[2] = *reinterpret_cast<const unsigned*>(a_row + k0 + 8);
        a[3] = *reinterpret_cast<const unsigned*>(a_row + 8 * S::KS + k0 + 8);
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) {
            const __half* b_row = sW + (nt * 8 + g) * S::KS + k0 + 2 * t;
            unsigned b[2];
            b[0] = *reinterpret_cast<const unsigned*>(b_row);
            b[1] = *reinterpret_cast<const unsigned*>(b_row + 8);
            mma_16816(acc[nt], a, b);
        }
    }
    __syncthreads();  // every warp has read sA: it becomes sC now
    __half* sC = sA;
    const int r0 = warp * 16 + g;
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt) {
        const int col = nt * 8 + 2 * t;
        const float b0 = col < COUT ? __ldg(bias + col) : 0.0f;
        const float b1 = col + 1 < COUT ? __ldg(bias + col + 1) : 0.0f;
        *reinterpret_cast<__half2*>(sC + r0 * S::CS + col) = __floats2half2_rn(acc[nt][0] + b0, acc[nt][1] + b1);
        *reinterpret_cast<__half2*>(sC + (r0 + 8) * S::CS + col) = __floats2half2_rn(acc[nt][2] + b0, acc[nt][3] + b1);
    }
    __syncthreads();
}

// (4) out[p, n0 + c] = act(sC[r, c] (+ res[p, n0 + c])) for the tile's pixels p = base + r < M
// and this block's COUT channels (rows of out and res are ld channels long).
template <int COUT, bool RES, bool RELU>
__device__ __forceinline__ void store_tile(
    const __half* sC, const __half* __restrict__ res, __half* __restrict__ out, int base, int M,
    int ld, int n0) {
    using S = PwShape<COUT, COUT>;
    constexpr int V = VecWidth<COUT>::value;
    constexpr int GROUPS = COUT / V;
    for (int i = threadIdx.x; i < PW_BM * GROUPS; i += PW_THREADS) {
        const int r = i / GROUPS, c = (i - r * GROUPS) * V, p = base + r;
        if (p >= M) continue;
        finish_vec<V, RES, RELU>(sC + r * S::CS + c, res + p * ld + n0 + c, out + p * ld + n0 + c);
    }
}

// (4) with the head fused: logit[p] = hb + sum_c hw[c] * relu(sC[r, c] (+ res[p, c])).
// Two threads per pixel (all 128 threads for the 64 rows), each summing half the channels,
// joined with a shuffle: the per-pixel dot product is the epilogue's critical path.
template <int COUT, bool RES>
__device__ __forceinline__ void store_tile_head(
    const __half* sC, const __half* __restrict__ res, const float* __restrict__ hw, float hb,
    float* __restrict__ logits, int base, int M) {  // res rows: COUT channels (no slicing)
    using S = PwShape<COUT, COUT>;
    static_assert(PW_THREADS == 2 * PW_BM, "two threads per tile row");
    const int r = threadIdx.x >> 1, part = threadIdx.x & 1, p = base + r;
    const bool valid = p < M;
    const float s = head_logit<COUT, RES>(sC + r * S::CS, res, p, valid, hw, part);
    if (valid && part == 0) logits[p] = s + hb;
}

}  // namespace sd
