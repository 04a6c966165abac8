// ds_split: a depthwise-separable block as two launches, for the wide blocks where the fused
// ds_block.cu cannot keep the SM busy (its whole pointwise weight lives in shared memory, so a
// 384-channel block runs one 4-warp block per SM and serialises depthwise, GEMM and epilogue).
//
//   dw_stage  [N, Ho, Wo, CIN] = relu(dw3x3(src) + b)   src: x, or the decoder join
//             concat(nearest_up2x(x), skip) read on the fly (DwSource); one thread per
//             (P pixels of a row, 8 channels): dw_group.cuh, the fused kernel's own code
//   pw_gemm   out = relu(half(A @ W + bias) (+ res))    a tiled tensor-core GEMM
//
// pw_gemm: a block owns BM = 128 rows (pixels) x BN output channels and walks K in steps of
// BK through a ring of STAGES shared buffers filled by cp.async (the copies of the next
// STAGES - 1 steps are in flight while step k multiplies; one barrier per step). 8 warps:
// 4 along M (32 rows each: two m16 tiles) x 2 along N (BN/2 columns: NT n8 tiles).
// Fragments come from shared memory through ldmatrix.
//
//   dynamic shared memory (halves)
//   ┌────────────────────────────────────┬────────────────────────────────────┐
//   │ sA [STAGES][BM][KS]  rows of A      │ sB [STAGES][BN][KS]  rows of Wᵀ     │
//   └────────────────────────────────────┴────────────────────────────────────┘
//   KS = BK + 8: a row is an odd number of 16-byte units, so ldmatrix's 8 rows hit 8
//   distinct bank groups. Step k lives in buffer k % STAGES.
// The weight comes transposed ([COUT, K], k contiguous) so both operands load as 16-byte rows.
// The epilogue stages half(acc + bias) in shared memory and writes whole 16-byte rows.
// Numerics match ds_block.cu: the depthwise result is rounded to fp16, the products summed
// in fp32 over k in ascending 16-steps, acc + bias rounded to fp16, then residual and ReLU
// in fp32, stored as fp16. Rows past M read zeros (cp.async zero-fill) and are not stored.
#include "dw_group.cuh"
#include "mma_tile.cuh"

template <int CA, int CB, int STRIDE, int DIL, int P, bool HOIST>
__global__ void __launch_bounds__(256) dw_stage(
    const __half* __restrict__ x,     // [N, H, W, CA]; with CB > 0: [N, H/2, W/2, CA]
    const __half* __restrict__ skip,  // [N, H, W, CB] (CB > 0 only)
    const __half* __restrict__ w,     // [3, 3, CA + CB]
    const float* __restrict__ b,      // [CA + CB]
    __half* __restrict__ out,         // [N, Ho, Wo, CA + CB]
    int N, int H, int W, int Ho, int Wo) {  // Wo % P == 0
    constexpr int C = CA + CB, KP = (C + 15) / 16 * 16;
    constexpr int V = (CA % 8 == 0 && CB % 8 == 0) ? 8 : 1;
    constexpr int GROUPS = C / V;
    extern __shared__ __align__(16) float sDw[];  // [9][KP], zero beyond C
    for (int i = threadIdx.x; i < 9 * KP; i += blockDim.x) {
        const int t = i / KP, c = i - t * KP;
        sDw[i] = c < C ? __half2float(w[t * C + c]) : 0.0f;
    }
    __syncthreads();
    const sd::DwSource<CA, CB> src{x, skip, H, W};
    const int plane = Ho * Wo, items = N * plane / P * GROUPS;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
        const int g = i / GROUPS, c = (i - g * GROUPS) * V, p0 = g * P;
        const int n = p0 / plane, rem = p0 - n * plane, oy = rem / Wo, ox0 = rem - oy * Wo;
        float acc[P][V];
        sd::dw_row_group<V, P, STRIDE, DIL, HOIST, KP>(src, sDw, b, n, oy, ox0, c, acc);
#pragma unroll
        for (int q = 0; q < P; ++q) sd::store_h<V>(out + (p0 + q) * C + c, acc[q]);
    }
}

template <int K, int COUT, int BN, int BK, int STAGES, bool RES>
__global__ void __launch_bounds__(sd::GEMM_THREADS) pw_gemm(
    const __half* __restrict__ a,     // [M, K]
    const __half* __restrict__ wt,    // [COUT, K]: the pointwise weight, transposed
    const float* __restrict__ bias,   // [COUT]
    const __half* __restrict__ res,   // [M, COUT] (RES only)
    __half* __restrict__ out,         // [M, COUT]
    int M) {
    constexpr int BM = sd::GEMM_BM, KS = BK + 8, KT = K / BK, CH = BK / 8;
    constexpr int WN = BN / 2, NT = WN / 8;
    static_assert(K % BK == 0 && BK % 16 == 0, "K is whole BK steps, BK whole k16 steps");
    static_assert(COUT % BN == 0 && BN % 16 == 0, "BN splits COUT into whole warp columns");
    static_assert((KS / 8) % 2 == 1, "odd 16-byte units per row: conflict-free ldmatrix");
    static_assert(STAGES >= 2, "at least double buffering");
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sA = reinterpret_cast<__half*>(smem);  // [STAGES][BM * KS]
    __half* sB = sA + STAGES * BM * KS;            // [STAGES][BN * KS]
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp & 3) * 32, wn = (warp >> 2) * WN;

    // Stage k-step `kt` into buffer kt % STAGES; past the last step, an empty group, so that
    // every thread always has exactly STAGES - 1 groups in flight at the wait below.
    auto load = [&](int kt) {
        if (kt < KT) {
            __half* dA = sA + (kt % STAGES) * BM * KS;
            __half* dB = sB + (kt % STAGES) * BN * KS;
            const int k0 = kt * BK;
            for (int i = threadIdx.x; i < BM * CH; i += sd::GEMM_THREADS) {
                const int r = i / CH, c = (i - r * CH) * 8, m = m0 + r;
                const bool valid = m < M;
                sd::cp_async16(dA + r * KS + c, a + (valid ? m : 0) * K + k0 + c, valid);
            }
            for (int i = threadIdx.x; i < BN * CH; i += sd::GEMM_THREADS) {
                const int r = i / CH, c = (i - r * CH) * 8;
                sd::cp_async16(dB + r * KS + c, wt + (n0 + r) * K + k0 + c, true);
            }
        }
        sd::cp_async_commit();
    };

    float acc[2][NT][4];
    sd::zero_acc(acc);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s);
    for (int kt = 0; kt < KT; ++kt) {
        sd::cp_async_wait<STAGES - 2>();  // step kt has landed (this thread's copies)
        __syncthreads();                  // ... everyone's; and step kt - 1 is consumed
        load(kt + STAGES - 1);            // refill the buffer step kt - 1 used
        sd::warp_mma_step<BN, BK>(
            sA + (kt % STAGES) * BM * KS, sB + (kt % STAGES) * BN * KS, acc, wm, wn, lane);
    }

    // Epilogue: half(acc + bias) is staged in shared memory (the ring is free once every warp
    // is past the k loop), then each thread finishes 8 channels of a row with 16-byte loads
    // of the residual and 16-byte stores, so a warp writes whole rows.
    constexpr int CS = BN + 8;  // row stride of the staged tile (stage_acc)
    static_assert(BM * CS <= STAGES * (BM + BN) * KS, "the staged tile fits in the ring");
    sd::cp_async_wait<0>();  // only empty groups are left, but keep the ring quiet
    __syncthreads();
    sd::stage_acc<BN>(sA, acc, bias + n0, wm, wn, lane);
    __syncthreads();
    sd::store_rows<BN, COUT, RES>(sA, res, out, m0, n0, M);
}

// ds_tiled: the whole block in one kernel on pw_gemm's tiling. The A operand of k step kt
// (BM pixels x BK channels) is not loaded but computed: the depthwise stage of those pixels
// and channels (dw_group.cuh, the fused kernel's code) straight into a double-buffered
// shared tile, while the transposed weight streams through the cp.async ring as in pw_gemm.
// Step kt + 1's depthwise work follows step kt's MMAs in each warp, so with two blocks per
// SM one warp's loads overlap another's tensor-core work; one barrier per k step. The
// depthwise output never reaches device memory (ds_split's scratch round trip is gone), at
// the price of recomputing it per column tile (COUT / BN times). With HEAD (BN == COUT) the
// epilogue reduces each pixel to the 1x1 head's logit like ds_block.cu's, in its order.
//
//   dynamic shared memory: sDw [9][K] fp32 | sA [2][BM][KS] halves | sB [STAGES][BN][KS] halves
template <int CA, int CB, int COUT, int BN, int BK, int STAGES, int STRIDE, int DIL, int P, bool HOIST, bool RES, bool HEAD>
__global__ void __launch_bounds__(sd::GEMM_THREADS, 2) ds_tiled(
    const __half* __restrict__ x,     // [N, H, W, CA]; with CB > 0: [N, H/2, W/2, CA]
    const __half* __restrict__ skip,  // [N, H, W, CB] (CB > 0 only)
    const __half* __restrict__ dw_w,  // [3, 3, CA + CB]
    const float* __restrict__ dw_b,   // [CA + CB]
    const __half* __restrict__ wt,    // [COUT, CA + CB]: the pointwise weight, transposed
    const float* __restrict__ bias,   // [COUT]
    const float* __restrict__ head_w, // [COUT] (HEAD only)
    const float* __restrict__ head_b, // [1] (HEAD only)
    void* __restrict__ out,           // [N, Ho, Wo, COUT] half; HEAD: [N, Ho, Wo, 1] float
    int N, int H, int W, int Ho, int Wo) {  // Wo % P == 0
    constexpr int K = CA + CB, BM = sd::GEMM_BM, KS = BK + 8, KT = K / BK, CH = BK / 8;
    constexpr int WN = BN / 2, NT = WN / 8, GROUPS = BK / 8;
    static_assert(CA % 8 == 0 && CB % 8 == 0 && K % 16 == 0, "8-channel groups, k16 steps");
    static_assert(K % BK == 0 && BK % 16 == 0, "K is whole BK steps, BK whole k16 steps");
    static_assert(COUT % BN == 0 && BN % 16 == 0, "BN splits COUT into whole warp columns");
    static_assert((KS / 8) % 2 == 1, "odd 16-byte units per row: conflict-free ldmatrix");
    static_assert(STAGES >= 2 && BM % P == 0, "a ring; tiles of whole P-groups");
    static_assert(!HEAD || BN == COUT, "the head needs every channel of a pixel in one block");
    static_assert(!RES || (STRIDE == 1 && CB == 0 && CA == COUT), "residual needs matching shapes");
    extern __shared__ __align__(16) unsigned char smem[];
    float* sDw = reinterpret_cast<float*>(smem);                 // [9][K]
    __half* sA = reinterpret_cast<__half*>(sDw + 9 * K);         // [2][BM * KS]
    __half* sB = sA + 2 * BM * KS;                               // [STAGES][BN * KS]
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int plane = Ho * Wo, M = N * plane;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp & 3) * 32, wn = (warp >> 2) * WN;
    const sd::DwSource<CA, CB> src{x, skip, H, W};

    auto load_b = [&](int kt) {
        if (kt < KT) {
            __half* dB = sB + (kt % STAGES) * BN * KS;
            for (int i = threadIdx.x; i < BN * CH; i += sd::GEMM_THREADS) {
                const int r = i / CH, c = (i - r * CH) * 8;
                sd::cp_async16(dB + r * KS + c, wt + (n0 + r) * K + kt * BK + c, true);
            }
        }
        sd::cp_async_commit();
    };
    // A of step kt: relu(dw3x3 + b) of the tile's pixels, channels [kt*BK, kt*BK + BK).
    auto make_a = [&](int kt) {
        __half* dA = sA + (kt & 1) * BM * KS;
        for (int i = threadIdx.x; i < (BM / P) * GROUPS; i += sd::GEMM_THREADS) {
            const int g = i / GROUPS, cl = (i - g * GROUPS) * 8, r0 = g * P, p0 = m0 + r0;
            float acc[P][8];
            if (p0 < M) {  // M is a multiple of P: the whole group is valid
                const int n = p0 / plane, rem = p0 - n * plane, oy = rem / Wo, ox0 = rem - oy * Wo;
                sd::dw_row_group<8, P, STRIDE, DIL, HOIST, K>(src, sDw, dw_b, n, oy, ox0, kt * BK + cl, acc);
            } else {
#pragma unroll
                for (int q = 0; q < P; ++q) sd::fill<8>(acc[q], 0.0f);
            }
#pragma unroll
            for (int q = 0; q < P; ++q) sd::store_h<8>(dA + (r0 + q) * KS + cl, acc[q]);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load_b(s);
    for (int i = threadIdx.x; i < 9 * K; i += sd::GEMM_THREADS) sDw[i] = __half2float(dw_w[i]);
    __syncthreads();
    make_a(0);

    float acc[2][NT][4];
    sd::zero_acc(acc);

    for (int kt = 0; kt < KT; ++kt) {
        sd::cp_async_wait<STAGES - 2>();  // B of step kt has landed (this thread's copies)
        __syncthreads();                  // ... everyone's, A of step kt is made, kt - 1 is done
        load_b(kt + STAGES - 1);
        sd::warp_mma_step<BN, BK>(
            sA + (kt & 1) * BM * KS, sB + (kt % STAGES) * BN * KS, acc, wm, wn, lane);
        if (kt + 1 < KT) make_a(kt + 1);  // the other A buffer: its last reader was step kt - 1
    }

    // Epilogue, as pw_gemm's: half(acc + bias) staged over the A and B buffers (contiguous),
    // then whole rows.
    constexpr int CS = BN + 8;
    static_assert(BM * CS <= (2 * BM + STAGES * BN) * KS, "the staged tile fits in the buffers");
    sd::cp_async_wait<0>();
    __syncthreads();
    __half* sC = sA;
    sd::stage_acc<BN>(sC, acc, bias + n0, wm, wn, lane);
    __syncthreads();
    if constexpr (HEAD) {
        static_assert(sd::GEMM_THREADS == 2 * BM, "two threads per tile row");
        const int r = threadIdx.x >> 1, part = threadIdx.x & 1, p = m0 + r;
        const bool valid = p < M;
        const float s = sd::head_logit<COUT, RES>(sC + r * CS, x, p, valid, head_w, part);
        if (valid && part == 0) static_cast<float*>(out)[p] = s + head_b[0];
    } else {
        sd::store_rows<BN, COUT, RES>(sC, x, static_cast<__half*>(out), m0, n0, M);
    }
}
