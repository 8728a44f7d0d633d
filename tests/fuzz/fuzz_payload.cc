// libFuzzer target: every payload decoder (compress/codec.h) on arbitrary
// bytes. Byte 0 picks the codec, byte 1 the element count, byte 2 the block
// size; the rest is the payload. Nothing may crash or read out of bounds,
// and Decode and DecodeAverage must accept exactly what ValidatePayload
// accepts, leaving their output alone when they refuse.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "compress/codec.h"

namespace {

using morse::compress::CodecKind;
using morse::compress::CodecSpec;

void Require(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  CodecSpec spec;
  spec.kind = static_cast<CodecKind>(data[0] % 7);
  const size_t n = 1 + data[1] % 300;
  static constexpr uint32_t kBlocks[] = {16, 32, 64, 2048};
  spec.block_elems = kBlocks[data[2] % 4];
  spec.topk_ratio = 0.1;
  spec.rounding = (data[2] & 4) ? morse::compress::Rounding::kStochastic
                                : morse::compress::Rounding::kNearestEven;
  spec.scale = (data[2] & 8) ? morse::compress::ScaleKind::kL1
                             : morse::compress::ScaleKind::kL2;
  const absl::Span<const uint8_t> payload(data + 3, size - 3);
  const bool valid = morse::compress::ValidatePayload(spec, payload, n).ok();

  std::vector<float> out(n, 7.0f);
  const bool decoded =
      morse::compress::Decode(spec, payload, absl::MakeSpan(out)).ok();
  Require(decoded == valid);
  if (!decoded) {
    for (float f : out) Require(f == 7.0f);  // refused: untouched
  }

  std::vector<float> average(n, 7.0f);
  const std::vector<absl::Span<const uint8_t>> two = {payload, payload};
  const bool averaged =
      morse::compress::DecodeAverage(spec, two, absl::MakeSpan(average)).ok();
  Require(averaged == valid);
  if (averaged) {
    // The average of two equal payloads is the payload, bit for bit, where
    // doubling does not overflow.
    for (size_t j = 0; j < n; ++j) {
      if (std::abs(out[j]) < 1e30f)
        Require(std::memcmp(&average[j], &out[j], 4) == 0 || out[j] == 0.0f);
    }
  } else {
    for (float f : average) Require(f == 7.0f);
  }
  return 0;
}
