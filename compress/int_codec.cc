// int8 and int4 (DESIGN 2.3): per block one fp32 scale max|u|/q_max, then
// two's-complement q in [-q_max, q_max]; int4 packs element 2k in the low
// nibble of byte k.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec_parts.h"
#include "compress/kernels.h"

namespace morse::compress {
namespace {

// Index of the first byte equal to `value`, or n.
size_t FindByte(const uint8_t* p, size_t n, uint8_t value) {
  if (n == 0) return 0;  // memchr's pointer must not be null, even for 0 bytes
  const void* hit = std::memchr(p, value, n);
  return hit ? static_cast<size_t>(static_cast<const uint8_t*>(hit) - p) : n;
}

// Index of the first byte with a nibble equal to 8 (int4's -8), or n. Eight
// bytes at a time: a nibble is 8 iff it is zero after xor with 8, found by
// the has-zero-byte trick on each nibble position.
size_t FindNibble8(const uint8_t* p, size_t n) {
  constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0Full,
                     kEights = 0x0808080808080808ull;
  constexpr uint64_t kOnes = 0x0101010101010101ull,
                     kHigh = 0x8080808080808080ull;
  const auto has_zero_byte = [](uint64_t v) {
    return ((v - kOnes) & ~v & kHigh) != 0;
  };
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t w;
    std::memcpy(&w, p + k, 8);
    if (has_zero_byte((w & kLow) ^ kEights) ||
        has_zero_byte(((w >> 4) & kLow) ^ kEights))
      break;
  }
  for (; k < n; ++k) {
    if ((p[k] & 0x0F) == 0x08 || (p[k] & 0xF0) == 0x80) return k;
  }
  return n;
}

int BitsPerElem(const CodecSpec& spec) {
  return spec.kind == CodecKind::kInt8 ? 8 : 4;
}

}  // namespace

absl::Status IntCodec::Encode(const CodecSpec& spec, absl::Span<const float> x,
                              absl::Span<float> error, FeedbackArgs fb,
                              const RoundingKey& key,
                              absl::Span<uint8_t> payload) {
  const size_t blocks = BlockCount(spec, x.size());
  std::vector<float> scales(blocks);
  const StochasticArgs sr{key};
  const bool ok = ActiveKernels().int_encode(
      BitsPerElem(spec), x.data(), error.empty() ? nullptr : error.data(),
      x.size(), spec.block_elems, fb,
      spec.rounding == Rounding::kStochastic ? &sr : nullptr, scales.data(),
      payload.data() + 4 * blocks);
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(CodecName(spec.kind),
                     ": the input holds Inf or NaN, so a block scale "
                     "would not be finite"));
  }
  if (blocks > 0) std::memcpy(payload.data(), scales.data(), 4 * blocks);
  return absl::OkStatus();
}

absl::Status IntCodec::Validate(const CodecSpec& spec,
                                absl::Span<const uint8_t> payload, size_t n) {
  const size_t blocks = BlockCount(spec, n);
  if (absl::Status s =
          CheckScales(payload.data(), blocks, CodecName(spec.kind));
      !s.ok()) {
    return s;
  }
  // The encoder clamps to [-q_max, q_max]; -q_max - 1 is malformed.
  const uint8_t* data = payload.data() + 4 * blocks;
  const size_t bytes = payload.size() - 4 * blocks;
  const size_t bad = spec.kind == CodecKind::kInt8 ? FindByte(data, bytes, 0x80)
                                                   : FindNibble8(data, bytes);
  if (bad < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(CodecName(spec.kind), ": byte ", bad,
                     " holds a value outside [-q_max, q_max]"));
  }
  if (spec.kind == CodecKind::kInt4 && n % 2 == 1 && bytes > 0 &&
      (data[bytes - 1] & 0xF0) != 0) {
    return absl::InvalidArgumentError(
        "int4: the unused high nibble of the last byte is not zero");
  }
  return absl::OkStatus();
}

void IntCodec::Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                      absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled({payload}, blocks);
  ActiveKernels().int_decode(BitsPerElem(spec), split.scale_ptrs[0],
                             split.data_ptrs[0], out.size(), spec.block_elems,
                             out.data());
}

void IntCodec::Average(const CodecSpec& spec,
                       absl::Span<const absl::Span<const uint8_t>> payloads,
                       absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled(payloads, blocks);
  ActiveKernels().int_average(BitsPerElem(spec), split.scale_ptrs.data(),
                              split.data_ptrs.data(), payloads.size(),
                              out.size(), spec.block_elems, out.data());
}

}  // namespace morse::compress
