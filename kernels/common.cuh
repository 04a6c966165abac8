// Device helpers shared by the ScratchNet kernels (fp16 storage, fp32 arithmetic, NHWC).
//
// The Python loader (kernels/_cuda.py) pastes this header in front of each .cu file before
// NVRTC sees it, so CuPy's on-disk cache key covers the header too: editing it recompiles
// every module that uses it. A .cu file marks the spot with `#include "common.cuh"`.
//
// Index arithmetic is 32-bit: the launchers refuse tensors of 2^31 elements or more.
//
// Vector width V: 8 halves (one 16-byte load/store) when a tensor's channel count is a
// multiple of 8, else 1. Every kernel is a template over its channel counts, so the widths,
// loop bounds and register arrays below are compile-time constants.
#pragma once
#include <cuda_fp16.h>

namespace sd {

template <int C>
struct VecWidth {
    static constexpr int value = (C % 8 == 0) ? 8 : 1;
};

// V halves as loaded from memory, unconverted (16 bytes, or one half), so a thread can issue
// all its loads before it converts and uses any of them.
template <int V>
struct RawH;
template <>
struct RawH<8> {
    uint4 u;
};
template <>
struct RawH<1> {
    __half h;
};

template <int V>
__device__ __forceinline__ RawH<V> load_raw(const __half* __restrict__ p) {
    if constexpr (V == 8) {
        return RawH<8>{__ldg(reinterpret_cast<const uint4*>(p))};
    } else {
        return RawH<1>{p[0]};
    }
}

template <int V>
__device__ __forceinline__ RawH<V> zero_raw() {
    if constexpr (V == 8) {
        return RawH<8>{make_uint4(0u, 0u, 0u, 0u)};
    } else {
        return RawH<1>{__float2half(0.0f)};
    }
}

template <int V>
__device__ __forceinline__ void unpack(const RawH<V>& r, float (&f)[V]) {
    if constexpr (V == 8) {
        const __half2* h = reinterpret_cast<const __half2*>(&r.u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 t = __half22float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    } else {
        f[0] = __half2float(r.h);
    }
}

// p[0..V) (halves) → f[0..V) (floats). p must be 16-byte aligned when V == 8.
template <int V>
__device__ __forceinline__ void load_h(const __half* __restrict__ p, float (&f)[V]) {
    unpack<V>(load_raw<V>(p), f);
}

// Same as load_h, from shared memory (no read-only cache path).
template <int V>
__device__ __forceinline__ void load_h_smem(const __half* p, float (&f)[V]) {
    if constexpr (V == 8) {
        unpack<8>(RawH<8>{*reinterpret_cast<const uint4*>(p)}, f);
    } else {
        unpack<1>(RawH<1>{p[0]}, f);
    }
}

// p[0..V) (floats, shared memory, 16-byte aligned when V == 8) → f[0..V).
template <int V>
__device__ __forceinline__ void load_f_smem(const float* p, float (&f)[V]) {
    if constexpr (V == 8) {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = p[i];
    }
}

// f[0..V) → p[0..V) as halves (round to nearest).
template <int V>
__device__ __forceinline__ void store_h(__half* p, const float (&f)[V]) {
    if constexpr (V == 8) {
        uint4 u;
        __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        *reinterpret_cast<uint4*>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = __float2half_rn(f[i]);
    }
}

// o[0..V) = act(s[0..V) (+ res[0..V))) as halves: an epilogue's V channels of one pixel,
// `s` staged in shared memory, `res` read only with RES, ReLU with RELU.
template <int V, bool RES, bool RELU>
__device__ __forceinline__ void finish_vec(
    const __half* s, const __half* __restrict__ res, __half* __restrict__ o) {
    float v[V];
    load_h_smem<V>(s, v);
    if constexpr (RES) {
        float rv[V];
        load_h<V>(res, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] += rv[j];
    }
    if constexpr (RELU) {
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = fmaxf(v[j], 0.0f);
    }
    store_h<V>(o, v);
}

template <int V>
__device__ __forceinline__ void fill(float (&f)[V], float v) {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = v;
}

// The virtual input of a depthwise conv: either one NHWC tensor, or (UP) the decoder join
// concat(nearest_upsample2x(lo), skip) read on the fly, so the joined tensor never exists.
template <int CA, int CB>
struct DwSource {
    static constexpr int C = CA + CB;
    const __half* __restrict__ a;  // CB == 0: [N, H, W, CA]; else [N, H/2, W/2, CA]
    const __half* __restrict__ b;  // [N, H, W, CB] (CB > 0 only)
    int H, W;                      // the virtual input's size

    // Address of channel c of pixel (n, y, x); a V-wide group never straddles the two parts
    // (V == 8 only when CA and CB are multiples of 8).
    __device__ __forceinline__ const __half* at(int n, int y, int x, int c) const {
        if constexpr (CB == 0) {
            return a + ((n * H + y) * W + x) * CA + c;
        } else {
            if (c < CA) return a + ((n * (H >> 1) + (y >> 1)) * (W >> 1) + (x >> 1)) * CA + c;
            return b + ((n * H + y) * W + x) * CB + (c - CA);
        }
    }
};

// Depthwise 3x3 (zero padding = DIL) + bias + optional ReLU at output pixel (n, oy, ox),
// channels [c, c + V): acc = act(b[c] + sum_{ky,kx} in[s*oy + d*(ky-1), s*ox + d*(kx-1), c] * w).
template <int V, int STRIDE, int DIL, bool RELU, int CA, int CB>
__device__ __forceinline__ void dw_point(
    const DwSource<CA, CB>& src,
    const __half* __restrict__ w,  // [3, 3, C]
    const float* __restrict__ b,   // [C]
    int n, int oy, int ox, int c, float (&acc)[V]) {
    constexpr int C = CA + CB;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = __ldg(b + c + i);
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
        const int iy = oy * STRIDE + (ky - 1) * DIL;
        if (iy < 0 || iy >= src.H) continue;
#pragma unroll
        for (int kx = 0; kx < 3; ++kx) {
            const int ix = ox * STRIDE + (kx - 1) * DIL;
            if (ix < 0 || ix >= src.W) continue;
            float v[V], wv[V];
            load_h<V>(src.at(n, iy, ix, c), v);
            load_h<V>(w + (ky * 3 + kx) * C + c, wv);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] = fmaf(v[i], wv[i], acc[i]);
        }
    }
    if constexpr (RELU) {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaxf(acc[i], 0.0f);
    }
}

// The 1x1 head's logit of pixel p from its staged pointwise row `row` (fp16: acc + bias,
// before the residual and the block's ReLU, which it applies): two threads per pixel (part 0 and 1) each sum half the
// channels in ascending order, joined with a shuffle, so every DS path's logits are the same
// bits. Both threads of a pair call it (the shuffle); with `valid` false the residual is
// not read. The caller adds the head's bias.
template <int COUT, bool RES>
__device__ __forceinline__ float head_logit(
    const __half* row, const __half* __restrict__ res, int p, bool valid,
    const float* __restrict__ hw, int part) {  // res rows: COUT channels
    constexpr int HALF = (COUT + 1) / 2;
    float s = 0.0f;
#pragma unroll 4
    for (int j = 0; j < HALF; ++j) {
        const int c = part * HALF + j;
        if (c >= COUT) break;
        float v = __half2float(row[c]);
        if constexpr (RES) v += valid ? __half2float(res[p * COUT + c]) : 0.0f;
        v = fmaxf(v, 0.0f);
        s = fmaf(v, __ldg(hw + c), s);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s;
}

// Logistic sigmoid, overflow-free: from e = exp(-|x|), 1/(1+e) for x >= 0 and e/(1+e) below.
__device__ __forceinline__ float sigmoid(float x) {
    const float e = __expf(-fabsf(x));
    const float r = 1.0f / (1.0f + e);
    return x >= 0.0f ? r : e * r;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Bilinear 2x upsampling (half-pixel centres, clamped edges; PyTorch align_corners=False) of
// an NHWC tensor [N, h, w, C] at output pixel (n, Y, X), channel c. For a factor of exactly 2
// the weights are constant: out[2i] = .75 in[i] + .25 in[i-1], out[2i+1] = .75 in[i] + .25
// in[i+1] (indices clamped), along H first, then W (the reference's order).
template <typename T>
__device__ __forceinline__ float bilinear2x_at(const T* __restrict__ in, int h, int w, int C, int n, int Y, int X, int c) {
    const int iy = Y >> 1, ix = X >> 1;
    const int ny = (Y & 1) ? min(iy + 1, h - 1) : max(iy - 1, 0);
    const int nx = (X & 1) ? min(ix + 1, w - 1) : max(ix - 1, 0);
    const T* row0 = in + (n * h + iy) * w * C;
    const T* row1 = in + (n * h + ny) * w * C;
    const float a0 = 0.75f * to_float(row0[ix * C + c]) + 0.25f * to_float(row1[ix * C + c]);
    const float a1 = 0.75f * to_float(row0[nx * C + c]) + 0.25f * to_float(row1[nx * C + c]);
    return 0.75f * a0 + 0.25f * a1;
}

// One tensor-core step D += A(16x16, row) * B(16x8, col), fp16 in, fp32 accumulate.
// Fragment ownership (g = lane / 4, t = lane % 4): a[0] = A[g][2t..], a[1] = A[g+8][2t..],
// a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]; b[0] = B[2t..][g], b[1] = B[2t+8..][g];
// d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace sd
