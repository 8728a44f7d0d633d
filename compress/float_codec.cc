// fp32, fp16 and bf16 (DESIGN 2.3): raw little-endian values, no scales.
#include "compress/float_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compress/codec_parts.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {
namespace {

using simd::BitsFloat;
using simd::FloatBits;

void Store16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

uint16_t Load16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

absl::Status EncodeRaw(const CodecSpec& spec, absl::Span<const float> u,
                       absl::Span<uint8_t> payload) {
  uint8_t* out = payload.data();
  switch (spec.kind) {
    case CodecKind::kFp32:
      if (!u.empty()) std::memcpy(out, u.data(), 4 * u.size());
      break;
    case CodecKind::kFp16:
      for (size_t j = 0; j < u.size(); ++j)
        Store16(out + 2 * j, FloatToHalf(u[j]));
      break;
    default:
      for (size_t j = 0; j < u.size(); ++j)
        Store16(out + 2 * j, FloatToBfloat16(u[j]));
      break;
  }
  return absl::OkStatus();
}

void DecodeRaw(const CodecSpec& spec, absl::Span<const uint8_t> payload,
               absl::Span<float> out) {
  const uint8_t* in = payload.data();
  switch (spec.kind) {
    case CodecKind::kFp32:
      if (!out.empty()) std::memcpy(out.data(), in, 4 * out.size());
      break;
    case CodecKind::kFp16:
      for (size_t j = 0; j < out.size(); ++j)
        out[j] = HalfToFloat(Load16(in + 2 * j));
      break;
    default:
      for (size_t j = 0; j < out.size(); ++j)
        out[j] = Bfloat16ToFloat(Load16(in + 2 * j));
      break;
  }
}

}  // namespace

uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {
    // Below 2^-14: a subnormal half (or the smallest normal after rounding),
    // counted in units of 2^-24; the scaling by 2^24 is exact.
    return sign | static_cast<uint16_t>(std::nearbyint(BitsFloat(x) * 0x1p24f));
  }
  x += 0x0fffu + ((x >> 13) & 1u);  // round the 13 dropped bits to even
  return sign | static_cast<uint16_t>((x - 0x38000000u) >> 13);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    return BitsFloat(sign | FloatBits(static_cast<float>(mantissa) * 0x1p-24f));
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToBfloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float Bfloat16ToFloat(uint16_t b) { return BitsFloat(uint32_t{b} << 16); }

absl::Status FloatCodec::Encode(const CodecSpec& spec,
                                absl::Span<const float> x,
                                absl::Span<float> error, FeedbackArgs fb,
                                const RoundingKey&,
                                absl::Span<uint8_t> payload) {
  if (error.empty()) return EncodeRaw(spec, x, payload);
  return EncodeViaDecode(spec, x, error, fb, payload, EncodeRaw, DecodeRaw);
}

absl::Status FloatCodec::Validate(const CodecSpec&, absl::Span<const uint8_t>,
                                  size_t) {
  return absl::OkStatus();  // any bits are a value; the length was checked
}

void FloatCodec::Decode(const CodecSpec& spec,
                        absl::Span<const uint8_t> payload,
                        absl::Span<float> out) {
  DecodeRaw(spec, payload, out);
}

void FloatCodec::Average(const CodecSpec& spec,
                         absl::Span<const absl::Span<const uint8_t>> payloads,
                         absl::Span<float> out) {
  // AverageViaDecode's sum (+0, then the payloads in order, / N) a piece at
  // a time, so that each payload is read once and the sum stays in L1.
  constexpr size_t kPiece = 2048;
  const size_t width = ElementBytes(spec.kind);
  const float divisor = static_cast<float>(payloads.size());
  float decoded[kPiece];
  for (size_t at = 0; at < out.size(); at += kPiece) {
    const size_t len = std::min(kPiece, out.size() - at);
    float* sum = out.data() + at;
    std::fill(sum, sum + len, 0.0f);
    for (const auto& payload : payloads) {
      DecodeRaw(spec, payload.subspan(width * at, width * len),
                absl::MakeSpan(decoded, len));
      for (size_t j = 0; j < len; ++j) sum[j] += decoded[j];
    }
    for (size_t j = 0; j < len; ++j) sum[j] = sum[j] / divisor;
  }
}

}  // namespace morse::compress
