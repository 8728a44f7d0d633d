// The portable reference implementation of KernelTable: plain loops, one
// element at a time, in the evaluation order of simd/element_ops.h. It is the
// oracle for avx2/, avx512/ and the CUDA kernels, so it stays obvious.
#include "compress/kernels.h"

#include <cstring>

#include "compress/simd/element_ops.h"
#include "compress/stochastic_rounding.h"

namespace morse::compress {
namespace {

using simd::MinSize;

// x (+ e) at j, +0 where the mask (if any) is exactly 0.
float Input(const float* x, const float* e, const float* m, size_t j) {
  const float u = e ? x[j] + e[j] : x[j];
  return m != nullptr && m[j] == 0.0f ? 0.0f : u;
}

// Sum over one block of u^2 (l2) or |u| (l1), in the 16-lane order.
float BlockSum(const float* x, const float* e, const float* m, size_t len,
               ScaleKind scale) {
  float lanes[16] = {};
  for (size_t j = 0; j < len; ++j) {
    const float u = Input(x, e, m, j);
    lanes[j % 16] += scale == ScaleKind::kL2 ? u * u : std::fabs(u);
  }
  return simd::ReduceLanes16(lanes);
}

bool Sign1Encode(const float* x, float* e, size_t n, size_t block,
                 ScaleKind scale, FeedbackArgs fb, float* scales, uint8_t* bits,
                 const float* mask_v) {
  if (fb.kind == FeedbackKind::kNone) e = nullptr;
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t len = MinSize(block, n - start);
    const float* xb = x + start;
    float* eb = e ? e + start : nullptr;
    const float* mb = mask_v ? mask_v + start : nullptr;
    const float s =
        simd::Sign1Scale(BlockSum(xb, eb, mb, len, scale), len, scale);
    if (!simd::IsFiniteScale(s)) return false;
    scales[b] = s;
    std::memset(bits + start / 8, 0, (len + 7) / 8);
    for (size_t j = 0; j < len; ++j) {
      const float u = Input(xb, eb, mb, j);
      const bool negative = std::signbit(u);
      if (negative) bits[(start + j) / 8] |= uint8_t(1u << ((start + j) % 8));
      if (eb) {
        eb[j] = mb != nullptr && mb[j] == 0.0f
                    ? 0.0f
                    : simd::NextError(fb, eb[j], u, negative ? -s : s);
      }
    }
  }
  return true;
}

void Sign1Decode(const float* scales, const uint8_t* bits, size_t n,
                 size_t block, float* out) {
  for (size_t j = 0; j < n; ++j) {
    const float s = scales[j / block];
    out[j] = (bits[j / 8] >> (j % 8)) & 1 ? -s : s;
  }
}

void Sign1Average(const float* const* scales, const uint8_t* const* bits,
                  size_t count, size_t n, size_t block, float* out) {
  const float divisor = static_cast<float>(count);
  for (size_t j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (size_t i = 0; i < count; ++i) {
      const float s = scales[i][j / block];
      sum += (bits[i][j / 8] >> (j % 8)) & 1 ? -s : s;
    }
    out[j] = sum / divisor;
  }
}

bool IntEncode(int bits_per_elem, const float* x, float* e, size_t n,
               size_t block, FeedbackArgs fb, const StochasticArgs* sr,
               float* scales, uint8_t* data) {
  if (fb.kind == FeedbackKind::kNone) e = nullptr;
  const float qmax = static_cast<float>(simd::QMax(bits_per_elem));
  for (size_t start = 0, b = 0; start < n; start += block, ++b) {
    const size_t len = MinSize(block, n - start);
    const float* xb = x + start;
    float* eb = e ? e + start : nullptr;
    uint32_t amax_bits = 0;
    for (size_t j = 0; j < len; ++j) {
      const float u = eb ? xb[j] + eb[j] : xb[j];
      const uint32_t a = simd::FloatBits(u) & 0x7fffffffu;
      if (a > amax_bits) amax_bits = a;
    }
    if (amax_bits >= simd::kNonFiniteBits) return false;
    const float s = simd::BitsFloat(amax_bits) / qmax;
    scales[b] = s;
    if (bits_per_elem == 4) std::memset(data + start / 2, 0, (len + 1) / 2);
    for (size_t j = 0; j < len; ++j) {
      const float u = eb ? xb[j] + eb[j] : xb[j];
      float q = 0.0f;
      if (s != 0.0f) {
        const float v = u / s;
        q = sr ? StochasticRound(
                     v,
                     StochasticDraw(sr->key, sr->key.first_index + start + j))
               : std::nearbyint(v);
        q = simd::ClampQ(q, qmax);
      }
      simd::StoreQ(bits_per_elem, data, start + j, q);
      if (eb) eb[j] = simd::NextError(fb, eb[j], u, q * s);
    }
  }
  return true;
}

void IntDecode(int bits_per_elem, const float* scales, const uint8_t* data,
               size_t n, size_t block, float* out) {
  for (size_t j = 0; j < n; ++j) {
    out[j] = static_cast<float>(simd::LoadQ(bits_per_elem, data, j)) *
             scales[j / block];
  }
}

void IntAverage(int bits_per_elem, const float* const* scales,
                const uint8_t* const* data, size_t count, size_t n,
                size_t block, float* out) {
  const float divisor = static_cast<float>(count);
  for (size_t j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (size_t i = 0; i < count; ++i) {
      sum += static_cast<float>(simd::LoadQ(bits_per_elem, data[i], j)) *
             scales[i][j / block];
    }
    out[j] = sum / divisor;
  }
}

void AdamUpdate(const AdamScalars& s, const float* g, float* x, float* m,
                float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    simd::AdamElement(s, g[i], &x[i], &m[i], &v[i]);
}

void FrozenUpdate(const AdamScalars& s, const float* c, float* x, float* m,
                  const float* v, size_t n, bool mask) {
  for (size_t i = 0; i < n; ++i) {
    simd::FrozenElement(s, simd::MaskedByVariance(mask, v[i], c[i]), &x[i],
                        &m[i], v[i]);
  }
}

void Momentum(float beta1, const float* m, const float* g, float* out,
              size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = simd::MomentumElement(beta1, m[i], g[i]);
}

void LambSegmentSums(const LambScalars& s, const float* x, const float* m,
                     const float* v, const float* v_fresh, size_t n,
                     double out[3]) {
  float first[kSumSegment], second[kSumSegment], most[kSumSegment];
  for (size_t j = 0; j < n; ++j) {
    simd::LambTermsElement(s, x, m, v, v_fresh, j, first, second, most);
  }
  simd::LambSegmentFromTerms(first, second, most, n, out);
}

void LambUpdateX(const LambScalars& s, float step, float* x, const float* m,
                 const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    simd::LambUpdateElement(s, step, &x[i], m[i], v[i]);
}

void LambMoments(const LambScalars& s, bool copy_fresh, bool mask,
                 const float* decoded, float* m, float* v, float* v_fresh,
                 size_t n) {
  for (size_t i = 0; i < n; ++i) {
    simd::LambMomentsElement(s, copy_fresh, mask, decoded[i], &m[i], &v[i],
                             &v_fresh[i]);
  }
}

void ZeroOneLocalStep(const AdamScalars& s, const float* g, float* x, float* m,
                      float* u, const float* v, size_t n, bool fresh,
                      bool write_x) {
  for (size_t i = 0; i < n; ++i) {
    simd::ZeroOneLocalElement(s, g[i], &x[i], &m[i], fresh ? 0.0f : u[i], &u[i],
                              v[i], write_x);
  }
}

void ZeroOneSyncMessage(const AdamScalars& s, float lr_sum, const float* u,
                        const float* v, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = simd::ZeroOneMessageElement(s, lr_sum, u[i], v[i]);
}

void ZeroOneSyncLocalStep(const AdamScalars& s, const AdamScalars& sync,
                          float lr_sum, const float* g, const float* x,
                          float* m, float* u, const float* v, size_t n,
                          bool fresh, float* out) {
  for (size_t i = 0; i < n; ++i) {
    float xi = x[i];  // read alone: write_x is false
    simd::ZeroOneLocalElement(s, g[i], &xi, &m[i], fresh ? 0.0f : u[i], &u[i],
                              v[i], /*write_x=*/false);
    out[i] = simd::ZeroOneMessageElement(sync, lr_sum, u[i], v[i]);
  }
}

void ZeroOneSyncStep(const AdamScalars& s, bool mask, const float* w,
                     const float* anchor, float* x, float* m, const float* v,
                     size_t n) {
  for (size_t i = 0; i < n; ++i)
    simd::ZeroOneSyncElement(s, mask, w[i], anchor[i], &x[i], &m[i], v[i]);
}

}  // namespace

const KernelTable& ScalarKernels() {
  static constexpr KernelTable kTable = {
      "scalar",           Sign1Encode,
      Sign1Decode,        Sign1Average,
      IntEncode,          IntDecode,
      IntAverage,         AdamUpdate,
      FrozenUpdate,       Momentum,
      LambSegmentSums,    LambUpdateX,
      LambMoments,        ZeroOneLocalStep,
      ZeroOneSyncMessage, ZeroOneSyncLocalStep,
      ZeroOneSyncStep,    FillDraws,
  };
  return kTable;
}

}  // namespace morse::compress
