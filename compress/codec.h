// Codecs: the normative wire encodings of DESIGN 2.3.
//
// A codec turns n fp32 values (one partition) into a payload of exactly
// PayloadBytes(spec, n) bytes and back. Every scaled codec (sign1, int8, int4)
// writes all block scales first, then the packed elements:
//
//   [ ceil(n/B) x fp32 scale, little-endian ][ packed elements ]
//
// sign1 packs one bit per element, element j in bit (j mod 8) of byte j/8;
// int4 packs element 2k in the low nibble of byte k; int8 one byte each.
// topk writes k uint32 indices ascending, then the k fp32 values. fp32, fp16
// and bf16 are the raw little-endian values.
//
// Encoders write into a caller-provided span of the exact size; decoders
// validate the payload (length, finite scales, topk indices) before writing
// anything and return INVALID_ARGUMENT with a message on bad input.
// All functions are thread-compatible: they hold no state.
#ifndef MORSE_COMPRESS_CODEC_H_
#define MORSE_COMPRESS_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace morse::compress {

enum class CodecKind : uint8_t {
  kFp32,
  kFp16,
  kBf16,
  kInt8,
  kInt4,
  kSign1,
  kTopK
};

// How sign1 computes a block's scale: l2 = RMS, l1 = mean absolute value.
enum class ScaleKind : uint8_t { kL2, kL1 };

// How int8/int4 round u/s to an integer.
enum class Rounding : uint8_t { kNearestEven, kStochastic };

inline constexpr uint32_t kDefaultBlockElems = 2048;

struct CodecSpec {
  CodecKind kind = CodecKind::kSign1;
  // Elements per scale block. A positive multiple of 16 (see
  // ValidateCodecSpec).
  uint32_t block_elems = kDefaultBlockElems;
  ScaleKind scale = ScaleKind::kL2;            // sign1 only
  Rounding rounding = Rounding::kNearestEven;  // int8 and int4 only
  double topk_ratio = 0.01;                    // topk only, in (0, 1]
};

// The per-element key of stochastic rounding (DESIGN 2.3): the draw for
// element j of a payload is a function of (seed, step, rank, first_index + j)
// only, so that CPU and GPU, and retries, produce the same bits.
struct RoundingKey {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint64_t first_index = 0;  // global index of the payload's element 0
};

// How an encoder updates an error buffer after sending C(u), u = x + e
// (DESIGN 2.4): kNone sends C(x) and leaves e alone; kEf sets e = u - C(u);
// kEma sets e = (1 - beta) * e + beta * (u - C(u)). kEma with beta == 1 is
// kEf exactly (NormalizeFeedback), so the two give the same bits.
enum class FeedbackKind : uint8_t { kNone, kEf, kEma };

struct FeedbackArgs {
  FeedbackKind kind = FeedbackKind::kNone;
  float beta = 1.0f;
};

FeedbackArgs NormalizeFeedback(FeedbackArgs fb);

absl::string_view CodecName(CodecKind kind);
absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name);
absl::string_view ScaleName(ScaleKind scale);
absl::StatusOr<ScaleKind> ParseScaleKind(absl::string_view name);

// OK, or INVALID_ARGUMENT saying which field is wrong.
absl::Status ValidateCodecSpec(const CodecSpec& spec);

// Number of blocks (scales) of a payload of n elements.
size_t BlockCount(const CodecSpec& spec, size_t n);

// Number of values topk keeps of n: min(n, ceil(ratio * n)) in double
// precision (the ratio is a double so that 0.1 of 5000 is 500, not 501).
size_t TopKCount(double ratio, size_t n);

// Exact payload size in bytes of n elements. Requires a valid spec.
size_t PayloadBytes(const CodecSpec& spec, size_t n);

// Bytes per element of the codecs that encode each element on its own
// (fp32, fp16, bf16: elements [a, b) are bytes [w*a, w*b) of the payload,
// encoded, decoded and averaged alike in any piece); 0 for the others.
size_t ElementBytes(CodecKind kind);

// Encodes u into payload, which must be exactly PayloadBytes(spec, u.size())
// long. `key` is used only by stochastic rounding. Returns INVALID_ARGUMENT if
// the size is wrong or a scale (or a topk input) is not finite; the payload
// must then not be sent.
absl::Status Encode(const CodecSpec& spec, absl::Span<const float> u,
                    const RoundingKey& key, absl::Span<uint8_t> payload);

// Encodes u = x + error and updates error per fb; `error` must be x.size()
// long, or empty with FeedbackKind::kNone. Used by ErrorFeedback; sign1 and
// the integer codecs do it in one fused pass. mask_v (sign1 only; x.size()
// floats): ErrorFeedback's zero-variance mask in the same pass: where it is
// exactly 0, u is +0 and error is left +0.
absl::Status EncodeWithError(const CodecSpec& spec, absl::Span<const float> x,
                             absl::Span<float> error, FeedbackArgs fb,
                             const RoundingKey& key,
                             absl::Span<uint8_t> payload,
                             absl::Span<const float> mask_v = {});

// Checks that `payload` is a well-formed encoding of n elements: the exact
// length, finite scales, topk indices strictly ascending and below n.
absl::Status ValidatePayload(const CodecSpec& spec,
                             absl::Span<const uint8_t> payload, size_t n);

// Decodes payload into out (n = out.size()). On error out is not written.
absl::Status Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                    absl::Span<float> out);

// out = (sum over i in index order of Decode(payloads[i])) / payloads.size(),
// the server's average of DESIGN 2.1/2.5: the sum starts at +0.0 and adds the
// decoded contributions in the order given (rank order), then divides by N.
// Every payload is validated first; on error out is not written.
absl::Status DecodeAverage(const CodecSpec& spec,
                           absl::Span<const absl::Span<const uint8_t>> payloads,
                           absl::Span<float> out);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_CODEC_H_
