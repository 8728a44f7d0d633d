// Element formulas shared by every CPU implementation of KernelTable.
//
// These are the normative fp32 evaluation orders of DESIGN 2.1-2.4; the CUDA
// kernels spell the same operations with explicitly rounded intrinsics. Every
// function is `static inline` on purpose: the avx2/ and avx512/ translation
// units are compiled with wider instruction sets, and internal linkage keeps
// the linker from handing their copies to code that must run on any x86-64.
// Compile with -ffp-contract=off (the compress target does).
#ifndef MORSE_COMPRESS_SIMD_ELEMENT_OPS_H_
#define MORSE_COMPRESS_SIMD_ELEMENT_OPS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "compress/halving_sum.h"
#include "compress/kernels.h"

namespace morse::compress::simd {

static inline size_t MinSize(size_t a, size_t b) { return a < b ? a : b; }

static inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

static inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Bits of the largest finite fp32 magnitude + 1: anything at or above is
// infinite or NaN.
inline constexpr uint32_t kNonFiniteBits = 0x7f800000u;

// The fixed lane reduction described in kernels.h.
static inline float ReduceLanes16(const float lanes[16]) {
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = lanes[i];
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
  }
  return t[0];
}

// sign1 block scale from the reduced sum over `len` elements.
static inline float Sign1Scale(float sum, size_t len, ScaleKind scale) {
  const float mean = sum / static_cast<float>(len);
  return scale == ScaleKind::kL2 ? std::sqrt(mean) : mean;
}

static inline bool IsFiniteScale(float s) {
  return (FloatBits(s) & 0x7fffffffu) < kNonFiniteBits;
}

// The error after sending c for u (DESIGN 2.4).
static inline float NextError(FeedbackArgs fb, float e_old, float u, float c) {
  const float d = u - c;
  if (fb.kind == FeedbackKind::kEma) {
    return (1.0f - fb.beta) * e_old + fb.beta * d;
  }
  return d;
}

static inline float ClampQ(float q, float qmax) {
  return q < -qmax ? -qmax : (q > qmax ? qmax : q);
}

// Adam element: returns nothing, updates x, m, v in place.
static inline void AdamElement(const AdamScalars& s, float g, float* x,
                               float* m, float* v) {
  const float mi = s.beta1 * *m + (1.0f - s.beta1) * g;
  const float vi = s.beta2 * *v + (1.0f - s.beta2) * (g * g);
  const float m_hat = mi / s.bias_correction1;
  const float v_hat = vi / s.bias_correction2;
  const float step = m_hat / (std::sqrt(v_hat) + s.eps) + s.weight_decay * *x;
  *m = mi;
  *v = vi;
  *x = *x - s.lr * step;
}

// The ratio r clamped to [-bound, bound]; NaN stays NaN, and an infinite
// bound leaves r as it is. The vector kernels compute the same value as
// Max(-bound, Min(bound, r)) with x86's operand order.
static inline float BoundRatio(float r, float bound) {
  return r > bound ? bound : (r < -bound ? -bound : r);
}

// DESIGN 2.1's zero-variance mask: +0 where v is exactly 0 (either sign of
// zero; NaN is not 0), else w.
static inline float MaskedByVariance(bool mask, float v, float w) {
  return mask && v == 0.0f ? 0.0f : w;
}

// 1-bit Adam compression phase element: m = c, v frozen; m̂ = c / bc1 and
// v̂ = v / bc2 (both 1 without bias correction, which leaves c and v exact);
// the ratio m̂/(sqrt(v̂)+eps) is bounded by max_ratio (DESIGN 2.1).
static inline void FrozenElement(const AdamScalars& s, float c, float* x,
                                 float* m, float v) {
  const float m_hat = c / s.bias_correction1;
  const float v_hat = v / s.bias_correction2;
  const float ratio =
      BoundRatio(m_hat / (std::sqrt(v_hat) + s.eps), s.max_ratio);
  const float step = ratio + s.weight_decay * *x;
  *m = c;
  *x = *x - s.lr * step;
}

// 1-bit LAMB's direction of one element (design.md 2.8): u = p + wd*x with
// p = m̂/(sqrt(v̂)+eps), bounded by max_ratio once v is frozen, when also
// *ratio = (sqrt(v̂)+eps) / (sqrt(v'/bc2')+eps) (if ratio is not null).
static inline float LambDirection(const LambScalars& ls, float x, float m,
                                  float v, float v_fresh, float* p,
                                  float* ratio) {
  const AdamScalars& s = ls.adam;
  const float m_hat = m / s.bias_correction1;
  const float d = std::sqrt(v / s.bias_correction2) + s.eps;
  float q = m_hat / d;
  if (ls.frozen_variance) {
    q = BoundRatio(q, s.max_ratio);
    if (ratio != nullptr)
      *ratio = d / (std::sqrt(v_fresh / ls.fresh_correction2) + s.eps);
  }
  if (p != nullptr) *p = q;
  return q + s.weight_decay * x;
}

// Element j's terms of a LAMB segment's statistics: warmup first = x and
// second = u; compression first = u, second = p and most = d/d'.
static inline void LambTermsElement(const LambScalars& s, const float* x,
                                    const float* m, const float* v,
                                    const float* v_fresh, size_t j,
                                    float* first, float* second, float* most) {
  float p = 0.0f, ratio = 0.0f;
  const float u = LambDirection(s, x[j], m[j], v[j], v_fresh[j], &p, &ratio);
  first[j] = s.frozen_variance ? u : x[j];
  second[j] = s.frozen_variance ? p : u;
  most[j] = ratio;
}

// 1-bit LAMB's moments of one element from the decoded reply (masked first
// when `mask`, by v before the update): warmup, m = b1*m + (1-b1)*g and v =
// b2*v + (1-b2)*g*g, and v' = v when copy_fresh (the last warmup step);
// compression, g' = (c - b1*m)/(1-b1), v' = b2*v' + (1-b2)*g'*g', m = c.
static inline void LambMomentsElement(const LambScalars& s, bool copy_fresh,
                                      bool mask, float decoded, float* m,
                                      float* v, float* v_fresh) {
  const float b1 = s.adam.beta1, b2 = s.adam.beta2;
  const float c = MaskedByVariance(mask, *v, decoded);
  if (!s.frozen_variance) {
    *m = b1 * *m + (1.0f - b1) * c;
    *v = b2 * *v + (1.0f - b2) * (c * c);
    if (copy_fresh) *v_fresh = *v;
    return;
  }
  const float g = (c - b1 * *m) / (1.0f - b1);
  *v_fresh = b2 * *v_fresh + (1.0f - b2) * (g * g);
  *m = c;
}

// x = x - step*u for one element.
static inline void LambUpdateElement(const LambScalars& s, float step, float* x,
                                     float m, float v) {
  *x = *x - step * LambDirection(s, *x, m, v, 0.0f, nullptr, nullptr);
}

// One LAMB segment's statistics from its n <= kSumSegment terms: out[0] and
// out[1] the halving sums (halving_sum.h) of first^2 and second^2 in double
// (exact products), out[2] the maximum of most (each at least +0; NaN
// counts as 0), the terms past n being +0.
static inline void LambSegmentFromTerms(const float* first, const float* second,
                                        const float* most, size_t n,
                                        double out[3]) {
  double a[kSumSegment], b[kSumSegment];
  float top[kSumSegment];
  const auto terms = [&](size_t j) {
    a[j] = static_cast<double>(first[j]) * first[j];
    b[j] = static_cast<double>(second[j]) * second[j];
    top[j] = most[j] > 0.0f ? most[j] : 0.0f;
  };
  // A whole segment in a loop of constant length, which the compiler
  // vectorizes (each element on its own: the same values).
  if (n == kSumSegment) {
    for (size_t j = 0; j < kSumSegment; ++j) terms(j);
  } else {
    for (size_t j = 0; j < n; ++j) terms(j);
    for (size_t j = n; j < kSumSegment; ++j) a[j] = b[j] = top[j] = 0.0f;
  }
  out[0] = HalvingSum(a);
  out[1] = HalvingSum(b);
  // The maximum of the non-negative floats, as a double (any order gives it:
  // no NaN is left): in 16 independent lanes, which the compiler keeps in
  // vector registers, instead of one chain of 256 dependent comparisons.
  float lanes[16] = {};
  for (size_t j = 0; j < kSumSegment; j += 16) {
    for (size_t i = 0; i < 16; ++i)
      lanes[i] = top[j + i] > lanes[i] ? top[j + i] : lanes[i];
  }
  float biggest = 0.0f;
  for (size_t i = 0; i < 16; ++i)
    biggest = lanes[i] > biggest ? lanes[i] : biggest;
  out[2] = biggest;
}

// zero_one_adam (design.md 2.7). The bounded Adam ratio of the local and
// sync steps: bound(m_hat / (sqrt(v/bc2) + eps)).
static inline float ZeroOneDenominator(const AdamScalars& s, float v) {
  return std::sqrt(v / s.bias_correction2) + s.eps;
}

// One worker's local step on one element: m = b1*m + (1-b1)*g;
// d = bound((m/bc1) / (sqrt(v/bc2) + eps)) + wd*x; u = u + lr*d (u_old is
// +0 at the interval's first step); x = x - lr*d when write_x.
static inline void ZeroOneLocalElement(const AdamScalars& s, float g, float* x,
                                       float* m, float u_old, float* u, float v,
                                       bool write_x) {
  const float mi = s.beta1 * *m + (1.0f - s.beta1) * g;
  const float m_hat = mi / s.bias_correction1;
  const float d = BoundRatio(m_hat / ZeroOneDenominator(s, v), s.max_ratio) +
                  s.weight_decay * *x;
  *m = mi;
  *u = u_old + s.lr * d;
  if (write_x) *x = *x - s.lr * d;
}

// A worker's sync message element: (u * (sqrt(v/bc2) + eps)) / lr_sum.
static inline float ZeroOneMessageElement(const AdamScalars& s, float lr_sum,
                                          float u, float v) {
  return (u * ZeroOneDenominator(s, v)) / lr_sum;
}

// Every replica's sync update of one element from the decoded reply w
// (masked first), s.lr the interval's learning-rate sum.
static inline void ZeroOneSyncElement(const AdamScalars& s, bool mask, float w,
                                      float anchor, float* x, float* m,
                                      float v) {
  const float wj = MaskedByVariance(mask, v, w);
  *x = anchor - s.lr * BoundRatio(wj / ZeroOneDenominator(s, v), s.max_ratio);
  *m = wj;
}

static inline float MomentumElement(float beta1, float m, float g) {
  return beta1 * m + (1.0f - beta1) * g;
}

static inline int QMax(int bits_per_elem) {
  return bits_per_elem == 8 ? 127 : 7;
}

// Stores q (an integral float in [-qmax, qmax]) as element j of int8/int4
// data. int4 requires the byte to have been zeroed before its first nibble.
static inline void StoreQ(int bits_per_elem, uint8_t* data, size_t j, float q) {
  const int qi = static_cast<int>(q);
  if (bits_per_elem == 8) {
    data[j] = static_cast<uint8_t>(static_cast<int8_t>(qi));
  } else {
    data[j / 2] |= static_cast<uint8_t>((qi & 0xF) << (4 * (j & 1)));
  }
}

static inline int LoadQ(int bits_per_elem, const uint8_t* data, size_t j) {
  if (bits_per_elem == 8) return static_cast<int8_t>(data[j]);
  const int nibble = (data[j / 2] >> (4 * (j & 1))) & 0xF;
  return (nibble ^ 8) - 8;
}

}  // namespace morse::compress::simd

#endif  // MORSE_COMPRESS_SIMD_ELEMENT_OPS_H_
