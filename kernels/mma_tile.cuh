// The tensor-core tile helpers shared by ds_split.cu (pw_gemm, ds_tiled) and ds_halo.cu:
// cp.async copies, ldmatrix fragment loads, one warp's m16n8k16 step over a BK-deep slice of
// A (rows = pixels) and Wᵀ (rows = output channels) in shared memory, and the epilogue's
// staging of half(acc + bias) and 16-byte row stores. A block is GEMM_THREADS = 256 threads,
// 8 warps: 4 along M (32 rows each: two m16 tiles) x 2 along N (BN/2 columns: NT n8 tiles).
// Shared rows are KS = BK + 8 halves long (an odd number of 16-byte units, so ldmatrix's 8
// rows hit 8 distinct bank groups).
#pragma once
#include "common.cuh"

namespace sd {

// A generic pointer into shared memory as the 32-bit shared-window address PTX wants.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned s;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(s) : "l"(p));
    return s;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned s = smem_addr(dst);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __half* p) {
    const unsigned s = smem_addr(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const __half* p) {
    const unsigned s = smem_addr(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s));
}

constexpr int GEMM_BM = 128;
constexpr int GEMM_THREADS = 256;

// One warp's share of a BK-deep step: acc (2 m16 tiles x NT n8 tiles, warp origin wm, wn)
// += A[wm.., 0..BK) x B[wn.., 0..BK)ᵀ, fragments through ldmatrix, k16 steps ascending.
template <int BN, int BK>
__device__ __forceinline__ void warp_mma_step(
    const __half* A, const __half* B, float (&acc)[2][BN / 16][4], int wm, int wn, int lane) {
    constexpr int KS = BK + 8, NT = BN / 16;
    // ldmatrix row addresses: A x4 = rows 0-15 at k +0 (lanes 0-15) and +8 (lanes 16-31);
    // B x4 = n rows 0-7 at k +0, +8, then n rows 8-15 at k +0, +8 (two n8 tiles).
    const int a_row = lane & 15, a_k = (lane >> 4) * 8;
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_k = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        unsigned af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(af[mi], A + (wm + mi * 16 + a_row) * KS + kk + a_k);
#pragma unroll
        for (int nt = 0; nt + 1 < NT; nt += 2) {
            unsigned bf[4];
            ldmatrix_x4(bf, B + (wn + nt * 8 + b_row) * KS + kk + b_k);
            const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_16816(acc[mi][nt], af[mi], b0);
                mma_16816(acc[mi][nt + 1], af[mi], b1);
            }
        }
        if constexpr (NT % 2 == 1) {  // the last n8 tile alone: x2 (lanes 0-15 address)
            unsigned bf[2];
            ldmatrix_x2(bf, B + (wn + (NT - 1) * 8 + (lane & 7)) * KS + kk + b_k);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) mma_16816(acc[mi][NT - 1], af[mi], bf);
        }
    }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[2][NT][4]) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mi][nt][0] = acc[mi][nt][1] = acc[mi][nt][2] = acc[mi][nt][3] = 0.0f;
}

// sC[r][c] = half(acc + bias[c]) for the warp's rows and columns (sC rows BN + 8 halves:
// 16-byte rows whose half2 writes spread over the banks). The caller syncs around it.
template <int BN>
__device__ __forceinline__ void stage_acc(
    __half* sC, const float (&acc)[2][BN / 16][4], const float* __restrict__ bias, int wm, int wn,
    int lane) {
    constexpr int CS = BN + 8, NT = BN / 16;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = wn + nt * 8 + 2 * t;
        const float b0 = __ldg(bias + col), b1 = __ldg(bias + col + 1);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm + mi * 16 + g + 8 * h;
                *reinterpret_cast<__half2*>(sC + r * CS + col) =
                    __floats2half2_rn(acc[mi][nt][2 * h] + b0, acc[mi][nt][2 * h + 1] + b1);
            }
    }
}

// out[m0 + r, n0 + c] = relu(sC[r][c] (+ res)) for the tile's rows below M: each thread takes
// 8 channels of a row, 16-byte residual loads and stores, so a warp writes whole rows.
template <int BN, int COUT, bool RES>
__device__ __forceinline__ void store_rows(
    const __half* sC, const __half* __restrict__ res, __half* __restrict__ out, int m0, int n0,
    int M) {
    constexpr int CS = BN + 8, GROUPS = BN / 8;
    for (int i = threadIdx.x; i < GEMM_BM * GROUPS; i += GEMM_THREADS) {
        const int r = i / GROUPS, c = (i - r * GROUPS) * 8, row = m0 + r;
        if (row >= M) continue;
        finish_vec<8, RES, true>(sC + r * CS + c, res + row * COUT + n0 + c, out + row * COUT + n0 + c);
    }
}

}  // namespace sd
