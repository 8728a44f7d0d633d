// ErrorFeedback: one error buffer (a worker's e_i over all D parameters, or a
// server shard's e_s over its range) and the compression that feeds it
// (DESIGN 2.4).
//
// Compress(x) sends C(x + e) and updates e per the mode: none, ef (1-bit
// Adam), or ema with beta_e (LoCo). The buffer is kept as fp32, or as int8
// with one fp32 scale per block of block_elems (max|e|/127, round half to
// even), LoCo's memory saving; the block grid starts at element 0.
//
// Thread-compatible. Calls on disjoint, block-aligned ranges may run
// concurrently with fp32 storage and with int8 storage alike.
#ifndef MORSE_COMPRESS_ERROR_FEEDBACK_H_
#define MORSE_COMPRESS_ERROR_FEEDBACK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compress/codec.h"

namespace morse::compress {

enum class ErrorStorage : uint8_t { kFp32, kInt8 };

struct FeedbackSpec {
  FeedbackKind kind = FeedbackKind::kEf;
  float beta = 1.0f;  // kEma only, in (0, 1]
  ErrorStorage storage = ErrorStorage::kFp32;
};

absl::Status ValidateFeedbackSpec(const FeedbackSpec& spec);

class ErrorFeedback {
 public:
  // A zero error buffer of n elements. Requires a valid spec and a block size
  // that is a positive multiple of 16.
  ErrorFeedback(const FeedbackSpec& spec, size_t n, uint32_t block_elems);

  ErrorFeedback(const ErrorFeedback&) = delete;
  ErrorFeedback& operator=(const ErrorFeedback&) = delete;
  ErrorFeedback(ErrorFeedback&&) = default;
  ErrorFeedback& operator=(ErrorFeedback&&) = default;

  // Encodes elements [offset, offset + x.size()) of x + e into payload with
  // `codec` and updates that range of e. offset must be a multiple of
  // block_elems and the range inside the buffer. On INVALID_ARGUMENT (a
  // non-finite scale: Inf or NaN in x + e) the range's error is partly
  // updated and the payload must not be sent; training cannot go on from it.
  //
  // mask_v, when given (x.size() values: the frozen v of those elements),
  // applies DESIGN 2.1's zero-variance mask: where mask_v is exactly 0, u is
  // +0 (whatever x and e hold) and the new error is +0.
  absl::Status Compress(const CodecSpec& codec, size_t offset,
                        absl::Span<const float> x, const RoundingKey& key,
                        absl::Span<uint8_t> payload,
                        absl::Span<const float> mask_v = {});

  // Compress, except that on any error the range's error is exactly as it
  // was (DESIGN 4: bad input never changes a shard's state). With fp32
  // storage this costs a copy of the range's error; the other paths already
  // compute into a temporary and commit on success.
  absl::Status CompressOrKeep(const CodecSpec& codec, size_t offset,
                              absl::Span<const float> x, const RoundingKey& key,
                              absl::Span<uint8_t> payload,
                              absl::Span<const float> mask_v = {});

  // Copies the error of [offset, offset + out.size()) as fp32.
  void Read(size_t offset, absl::Span<float> out) const;
  // Replaces the whole buffer (from a checkpoint); INVALID_ARGUMENT if the
  // size differs or a value is not finite, and then nothing changes.
  absl::Status Restore(absl::Span<const float> error);
  // Replaces [offset, offset + error.size()): offset a multiple of
  // block_elems, the range inside the buffer and ending at a block boundary
  // or the buffer's end; INVALID_ARGUMENT otherwise or for a non-finite
  // value, and then nothing changes.
  absl::Status RestoreRange(size_t offset, absl::Span<const float> error);

  // Sum of e^2 in double precision, for metrics and tests.
  double SquaredNorm() const;
  size_t size() const { return size_; }
  const FeedbackSpec& spec() const { return spec_; }

 private:
  void Quantize(size_t offset, absl::Span<const float> error);
  absl::Status CompressMasked(const CodecSpec& codec, size_t offset,
                              absl::Span<const float> x, const RoundingKey& key,
                              absl::Span<uint8_t> payload,
                              absl::Span<const float> mask_v);
  // out = in where mask_v is not 0, +0 where it is (in may be out).
  static void SelectByZero(absl::Span<const float> mask_v,
                           absl::Span<const float> in, absl::Span<float> out);

  FeedbackSpec spec_;
  size_t size_;
  uint32_t block_elems_;
  std::vector<float> fp32_;    // kFp32 storage
  std::vector<int8_t> int8_;   // kInt8 storage: values
  std::vector<float> scales_;  // kInt8 storage: one per block
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_ERROR_FEEDBACK_H_
