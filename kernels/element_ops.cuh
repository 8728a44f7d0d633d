// Device versions of compress/simd/element_ops.h and of the conversions and
// Philox draws of compress/: the same fp32 operations in the same order,
// each spelled as an explicitly rounded intrinsic (__fadd_rn, __fmul_rn, ...)
// so that nvcc cannot contract them into FMAs (the files are also compiled
// with --fmad=false). Any change here must match the CPU reference bit for
// bit; tests/kernels/kernels_test.cc compares them.
#ifndef MORSE_KERNELS_ELEMENT_OPS_CUH_
#define MORSE_KERNELS_ELEMENT_OPS_CUH_

#include <cstdint>

#include "kernels/launch.h"

namespace morse::kernels::device {

// Mirrors compress::FeedbackKind.
enum Feedback : int { kFbNone = 0, kFbEf = 1, kFbEma = 2 };

using Adam = launch::AdamArgs;  // compress::AdamScalars' fields

// Launch shapes. Element-wise kernels stride over the elements with a grid of
// at most 2^20 CTAs; block kernels give each scale block a half-warp.
inline constexpr int kThreads = 256;
inline constexpr int kBlocksPerCta = kThreads / 16;

inline unsigned ElementGrid(size_t n) {
  const size_t ctas = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(ctas < (1u << 20) ? (ctas > 0 ? ctas : 1)
                                                 : (1u << 20));
}

inline unsigned BlockGrid(size_t blocks) {
  return static_cast<unsigned>((blocks + kBlocksPerCta - 1) / kBlocksPerCta);
}

// The scale block a half-warp encodes (block kernels): this thread's lane
// (0..15), the block's index, first element and length (0 for the threads
// past the last block, which still take part in the shuffles), and its
// slices of x and of the error buffer (null when there is none).
struct HalfWarpBlock {
  int lane;
  size_t index, start, len;
  const float* x;
  float* e;
};

__device__ __forceinline__ HalfWarpBlock ThisHalfWarpsBlock(const float* x,
                                                            float* e, size_t n,
                                                            uint32_t block) {
  HalfWarpBlock hb;
  hb.lane = threadIdx.x & 15;
  hb.index =
      static_cast<size_t>(blockIdx.x) * kBlocksPerCta + (threadIdx.x >> 4);
  hb.start = hb.index * block;
  const bool inside = hb.start < n;
  hb.len = !inside ? 0 : (n - hb.start < block ? n - hb.start : block);
  hb.x = x + (inside ? hb.start : 0);
  hb.e = e != nullptr && inside ? e + hb.start : nullptr;
  return hb;
}

#define MORSE_FOR_EACH_ELEMENT(j, n)                                          \
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; \
       j < (n); j += static_cast<size_t>(gridDim.x) * blockDim.x)

// The one launcher of the element-wise kernels: op(j) for every j < n, a
// grid-stride loop of ElementGrid(n) CTAs of kThreads. An operation is a
// __device__ lambda over its captured pointers and scalars (nvcc
// --extended-lambda), written once where its launcher is:
//   return ForEachElement(n, stream, [=] __device__(size_t j) { ... });
// Nothing is launched for n = 0.
template <typename Op>
__global__ void ForEachElementKernel(size_t n, Op op) {
  MORSE_FOR_EACH_ELEMENT(j, n) { op(j); }
}

template <typename Op>
cudaError_t ForEachElement(size_t n, cudaStream_t stream, Op op) {
  if (n == 0) return cudaSuccess;
  ForEachElementKernel<<<ElementGrid(n), kThreads, 0, stream>>>(n, op);
  return cudaGetLastError();
}

__device__ __forceinline__ float Add(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ float Sub(float a, float b) {
  return __fsub_rn(a, b);
}
__device__ __forceinline__ float Mul(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ float Div(float a, float b) {
  return __fdiv_rn(a, b);
}
__device__ __forceinline__ float Sqrt(float a) { return __fsqrt_rn(a); }

__device__ __forceinline__ bool IsFinite(float s) {
  return (__float_as_uint(s) & 0x7fffffffu) < 0x7f800000u;
}

// simd::NextError: the error after sending c for u.
__device__ __forceinline__ float NextError(int kind, float beta, float e_old,
                                           float u, float c) {
  const float d = Sub(u, c);
  if (kind == kFbEma) return Add(Mul(Sub(1.0f, beta), e_old), Mul(beta, d));
  return d;
}

__device__ __forceinline__ float Clamp(float q, float qmax) {
  return q < -qmax ? -qmax : (q > qmax ? qmax : q);
}

// simd::AdamElement.
__device__ __forceinline__ void AdamElement(const Adam& s, float g, float* x,
                                            float* m, float* v) {
  const float mi = Add(Mul(s.beta1, *m), Mul(Sub(1.0f, s.beta1), g));
  const float vi = Add(Mul(s.beta2, *v), Mul(Sub(1.0f, s.beta2), Mul(g, g)));
  const float m_hat = Div(mi, s.bias_correction1);
  const float v_hat = Div(vi, s.bias_correction2);
  const float step =
      Add(Div(m_hat, Add(Sqrt(v_hat), s.eps)), Mul(s.weight_decay, *x));
  *m = mi;
  *v = vi;
  *x = Sub(*x, Mul(s.lr, step));
}

// simd::BoundRatio.
__device__ __forceinline__ float BoundRatio(float r, float bound) {
  return r > bound ? bound : (r < -bound ? -bound : r);
}

// simd::FrozenElement: m = c, v frozen; m̂ = c / bc1, v̂ = v / bc2; the ratio
// bounded by max_ratio.
__device__ __forceinline__ void FrozenElement(const Adam& s, float c, float* x,
                                              float* m, float v) {
  const float m_hat = Div(c, s.bias_correction1);
  const float v_hat = Div(v, s.bias_correction2);
  const float ratio =
      BoundRatio(Div(m_hat, Add(Sqrt(v_hat), s.eps)), s.max_ratio);
  const float step = Add(ratio, Mul(s.weight_decay, *x));
  *m = c;
  *x = Sub(*x, Mul(s.lr, step));
}

// DESIGN 2.1's zero-variance mask as a selection: +0 where v is exactly 0
// (when masking), c elsewhere.
__device__ __forceinline__ float Masked(bool mask, float v, float c) {
  return mask && v == 0.0f ? 0.0f : c;
}

// simd::MomentumElement.
__device__ __forceinline__ float MomentumElement(float beta1, float m,
                                                 float g) {
  return Add(Mul(beta1, m), Mul(Sub(1.0f, beta1), g));
}

// The staged encoders' first pass (sign1.cu, int_codec.cu): a CTA copies its
// block into shared memory, u[j] = x_j + e_j (x_j replaced by the local
// momentum b1*m_j + (1-b1)*g_j when mb is given; e_j = 0 without eb), and
// e_old[j] = e_j when keep_e; 16-byte loads when kVector (arrays aligned).
// Calls seen(u_j) for every staged value (the int encoders' maximum).
template <bool kVector, class Seen>
__device__ __forceinline__ void StageBlock(const float* __restrict__ xb,
                                           const float* __restrict__ eb,
                                           const float* __restrict__ mb,
                                           float beta1, uint32_t len, float* u,
                                           float* e_old, bool keep_e,
                                           Seen seen) {
  uint32_t scalar_from = 0;
  if (kVector) {
    const uint32_t quads = len / 4;
    for (uint32_t q = threadIdx.x; q < quads; q += blockDim.x) {
      float4 xv = reinterpret_cast<const float4*>(xb)[q];
      if (mb != nullptr) {
        const float4 mv = reinterpret_cast<const float4*>(mb)[q];
        xv = make_float4(MomentumElement(beta1, mv.x, xv.x),
                         MomentumElement(beta1, mv.y, xv.y),
                         MomentumElement(beta1, mv.z, xv.z),
                         MomentumElement(beta1, mv.w, xv.w));
      }
      float4 uv = xv;
      if (eb != nullptr) {
        const float4 ev = reinterpret_cast<const float4*>(eb)[q];
        uv = make_float4(Add(xv.x, ev.x), Add(xv.y, ev.y), Add(xv.z, ev.z),
                         Add(xv.w, ev.w));
        if (keep_e) reinterpret_cast<float4*>(e_old)[q] = ev;
      }
      reinterpret_cast<float4*>(u)[q] = uv;
      seen(uv.x);
      seen(uv.y);
      seen(uv.z);
      seen(uv.w);
    }
    scalar_from = quads * 4;
  }
  for (uint32_t j = scalar_from + threadIdx.x; j < len; j += blockDim.x) {
    const float ev = eb != nullptr ? eb[j] : 0.0f;
    const float xv =
        mb != nullptr ? MomentumElement(beta1, mb[j], xb[j]) : xb[j];
    const float uv = eb != nullptr ? Add(xv, ev) : xv;
    u[j] = uv;
    if (keep_e) e_old[j] = ev;
    seen(uv);
  }
}

// compress/stochastic_rounding.h: Philox4x32-10 and the draw for a global
// element index.
__device__ __forceinline__ void Philox(uint32_t k0, uint32_t k1,
                                       uint32_t c[4]) {
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

__device__ __forceinline__ float StochasticDraw(uint64_t seed, uint64_t step,
                                                uint32_t rank, uint64_t index) {
  const uint64_t group = index / 4;
  uint32_t c[4] = {static_cast<uint32_t>(group),
                   static_cast<uint32_t>(group >> 32),
                   static_cast<uint32_t>(step), rank};
  Philox(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), c);
  return Mul(static_cast<float>(c[index % 4] >> 8), 0x1p-24f);
}

__device__ __forceinline__ float StochasticRound(float v, float draw) {
  const float f = floorf(v);
  return draw < Sub(v, f) ? Add(f, 1.0f) : f;
}

// compress::FloatToHalf / HalfToFloat / FloatToBfloat16 / Bfloat16ToFloat,
// on the bits, as the CPU does them.
__device__ __forceinline__ uint16_t FloatToHalf(float f) {
  uint32_t x = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;
  if (x < 0x38800000u) {
    return sign |
           static_cast<uint16_t>(rintf(Mul(__uint_as_float(x), 0x1p24f)));
  }
  x += 0x0fffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((x - 0x38000000u) >> 13);
}

__device__ __forceinline__ float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    return __uint_as_float(
        sign | __float_as_uint(Mul(static_cast<float>(mantissa), 0x1p-24f)));
  }
  if (exponent == 31)
    return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

__device__ __forceinline__ uint16_t FloatToBfloat16(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float Bfloat16ToFloat(uint16_t b) {
  return __uint_as_float(uint32_t{b} << 16);
}

}  // namespace morse::kernels::device

#endif  // MORSE_KERNELS_ELEMENT_OPS_CUH_
