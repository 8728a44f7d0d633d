// Compressed pipeline-stage boundaries (docs/design.md 2.9).
//
// Between two pipeline stages, activations flow forward and their gradients
// backward, one micro-batch at a time. Each direction of a boundary has a
// BoundarySpec: a codec of codec.h (fp32, fp16, bf16, int8, int4, topk; not
// sign1) and a feedback:
//
//   none   send C(x).
//   ef     send C(x + e_k) and set e_k = x + e_k - C(x + e_k), one error
//          buffer e_k per micro-batch slot k of the step (the tensor's shape;
//          a slot whose size changes starts again from zero).
//   aq     AQ-SGD, activations only: per-sample buffers b_i held by both
//          ends. A sample seen for the first time is sent in fp32 and
//          b_i = x_i; after that the sender sends C(x_i - b_i) for every row
//          of the micro-batch together and both ends add the decoded change,
//          b_i += D(C(x_i - b_i)), in the same fp32 order, so their buffers
//          stay bit-identical; the receiver's activation is b_i.
//
// A sender and a receiver each hold a BoundaryCodec with the same spec; the
// receiver's holds AQ-SGD's buffers and nothing else. Inference uses
// EncodeStateless/DecodeStateless: C(x), no state read or written.
//
// Thread-compatible.
#ifndef MORSE_COMPRESS_BOUNDARY_H_
#define MORSE_COMPRESS_BOUNDARY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/codec.h"

namespace morse::compress {

enum class BoundaryFeedback : uint8_t { kNone, kEf, kAqSgd };

struct BoundarySpec {
  CodecSpec codec{CodecKind::kFp32};
  BoundaryFeedback feedback = BoundaryFeedback::kNone;
};

// "CODEC[:RATIO][/BLOCK][+ef|+aq]": fp32, fp16, bf16, int8, int4 or topk
// (topk needs its ratio, in (0, 1]); BLOCK, the elements per scale of
// int8/int4 (a positive multiple of 16, default 2048). Examples: "fp32",
// "int4/128", "topk:0.1+ef", "int8+aq". INVALID_ARGUMENT saying what is
// wrong otherwise.
absl::StatusOr<BoundarySpec> ParseBoundarySpec(absl::string_view text);
// The canonical text of a spec (ParseBoundarySpec(BoundarySpecName(s)) == s).
std::string BoundarySpecName(const BoundarySpec& spec);

// Bytes of a payload of `rows` x `cols` values, `fresh` of whose rows are
// sent in full (AQ-SGD's first visits; 0 otherwise).
size_t BoundaryPayloadBytes(const BoundarySpec& spec, size_t rows, size_t cols,
                            size_t fresh);

class BoundaryCodec {
 public:
  explicit BoundaryCodec(const BoundarySpec& spec) : spec_(spec) {}

  const BoundarySpec& spec() const { return spec_; }

  // Sender. x: rows x cols values, row r of sample samples[r] (AQ-SGD needs
  // one sample index per row, each at most once; the others ignore them).
  // slot: ef's buffer. On error (a non-finite value, bad sizes) no state
  // changes and *payload is unspecified.
  absl::Status Encode(absl::Span<const float> x, size_t rows,
                      absl::Span<const int64_t> samples, uint32_t slot,
                      std::string* payload);
  // Receiver: writes the rows x cols values into out. Validates the payload
  // first (length, scales, indices, and for AQ-SGD that its fresh rows are
  // exactly the samples this end has not seen: FAILED_PRECONDITION when the
  // two ends' buffers disagree, e.g. one was restored from another step's
  // checkpoint); on error no state changes and out is not written.
  absl::Status Decode(absl::string_view payload, size_t rows,
                      absl::Span<const int64_t> samples, absl::Span<float> out);

  // Inference: C(x) with the spec's codec and no feedback; compress = false
  // sends fp32.
  static absl::Status EncodeStateless(const CodecSpec& codec,
                                      absl::Span<const float> x,
                                      std::string* payload);
  static absl::Status DecodeStateless(const CodecSpec& codec,
                                      absl::string_view payload,
                                      absl::Span<float> out);

  // The state (ef's buffers, AQ-SGD's per-sample buffers) as bytes, and
  // back. LoadState checks the spec, the format and every value first and
  // changes nothing on error (INVALID_ARGUMENT / DATA_LOSS).
  std::string SaveState() const;
  absl::Status LoadState(absl::string_view state);

  // How many samples have an AQ-SGD buffer.
  size_t samples_seen() const { return aq_.size(); }
  // A sample's AQ-SGD buffer, or nullptr.
  const std::vector<float>* SampleBuffer(int64_t sample) const;
  // ef's error buffer of a slot, or nullptr.
  const std::vector<float>* SlotError(uint32_t slot) const;

 private:
  absl::Status CheckShape(absl::Span<const float> x, size_t rows,
                          absl::Span<const int64_t> samples) const;

  BoundarySpec spec_;
  std::map<uint32_t, std::vector<float>> errors_;  // ef: slot -> e
  size_t aq_cols_ = 0;
  std::map<int64_t, std::vector<float>> aq_;  // sample -> b
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_BOUNDARY_H_
