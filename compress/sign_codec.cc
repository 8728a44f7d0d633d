// sign1 (DESIGN 2.3): per block one fp32 scale, then one bit per element.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec_parts.h"
#include "compress/kernels.h"

namespace morse::compress {
namespace {}  // namespace

absl::Status SignCodec::Encode(const CodecSpec& spec, absl::Span<const float> x,
                               absl::Span<float> error, FeedbackArgs fb,
                               const RoundingKey&,
                               absl::Span<uint8_t> payload) {
  return EncodeSign1(spec, x, error, fb, payload, /*mask_v=*/nullptr);
}

absl::Status EncodeSign1(const CodecSpec& spec, absl::Span<const float> x,
                         absl::Span<float> error, FeedbackArgs fb,
                         absl::Span<uint8_t> payload, const float* mask_v) {
  const size_t blocks = BlockCount(spec, x.size());
  std::vector<float> scales(blocks);
  if (!ActiveKernels().sign1_encode(
          x.data(), error.empty() ? nullptr : error.data(), x.size(),
          spec.block_elems, spec.scale, fb, scales.data(),
          payload.data() + 4 * blocks, mask_v)) {
    return absl::InvalidArgumentError(
        "sign1: a block scale is not finite (the input holds Inf or NaN, or "
        "its squares overflow fp32)");
  }
  if (blocks > 0) std::memcpy(payload.data(), scales.data(), 4 * blocks);
  return absl::OkStatus();
}

absl::Status SignCodec::Validate(const CodecSpec& spec,
                                 absl::Span<const uint8_t> payload, size_t n) {
  return CheckScales(payload.data(), BlockCount(spec, n), "sign1");
}

void SignCodec::Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                       absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled({payload}, blocks);
  ActiveKernels().sign1_decode(split.scale_ptrs[0], split.data_ptrs[0],
                               out.size(), spec.block_elems, out.data());
}

void SignCodec::Average(const CodecSpec& spec,
                        absl::Span<const absl::Span<const uint8_t>> payloads,
                        absl::Span<float> out) {
  const size_t blocks = BlockCount(spec, out.size());
  const ScaledPayloads split = SplitScaled(payloads, blocks);
  ActiveKernels().sign1_average(split.scale_ptrs.data(), split.data_ptrs.data(),
                                payloads.size(), out.size(), spec.block_elems,
                                out.data());
}

}  // namespace morse::compress
