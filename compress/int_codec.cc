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
    return absl::InvalidArgumentError(absl::StrCat(
        CodecName(spec.kind), ": the input holds Inf or NaN, so a block scale "
                              "would not be finite"));
  }
  if (blocks > 0) std::memcpy(payload.data(), scales.data(), 4 * blocks);
  return absl::OkStatus();
}

absl::Status IntCodec::Validate(const CodecSpec& spec,
                                absl::Span<const uint8_t> payload, size_t n) {
  const size_t blocks = BlockCount(spec, n);
  if (absl::Status s = CheckScales(payload.data(), blocks, CodecName(spec.kind));
      !s.ok()) {
    return s;
  }
  // The encoder clamps to [-q_max, q_max]; -q_max - 1 is malformed.
  const uint8_t* data = payload.data() + 4 * blocks;
  const size_t bytes = payload.size() - 4 * blocks;
  for (size_t k = 0; k < bytes; ++k) {
    const bool bad = spec.kind == CodecKind::kInt8
                         ? data[k] == 0x80
                         : (data[k] & 0x0F) == 0x08 || (data[k] & 0xF0) == 0x80;
    if (bad) {
      return absl::InvalidArgumentError(absl::StrCat(
          CodecName(spec.kind), ": byte ", k,
          " holds a value outside [-q_max, q_max]"));
    }
  }
  if (spec.kind == CodecKind::kInt4 && n % 2 == 1 && bytes > 0 &&
      (data[bytes - 1] & 0xF0) != 0) {
    return absl::InvalidArgumentError("int4: the unused high nibble of the last byte is not zero");
  }
  return absl::OkStatus();
}

void IntCodec::Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                      absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled({payload}, blocks);
  ActiveKernels().int_decode(BitsPerElem(spec), split.scale_ptrs[0],
                             split.data_ptrs[0], out.size(),
                             spec.block_elems, out.data());
}

void IntCodec::Average(const CodecSpec& spec,
                       absl::Span<const absl::Span<const uint8_t>> payloads,
                       absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled(payloads, blocks);
  ActiveKernels().int_average(BitsPerElem(spec), split.scale_ptrs.data(),
                              split.data_ptrs.data(), payloads.size(), out.size(),
                              spec.block_elems, out.data());
}

}  // namespace morse::compress
