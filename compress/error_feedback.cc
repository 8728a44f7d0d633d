#include "compress/error_feedback.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/scratch.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {

absl::Status ValidateFeedbackSpec(const FeedbackSpec& spec) {
  if (spec.kind == FeedbackKind::kEma &&
      !(spec.beta > 0.0f && spec.beta <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ema feedback needs beta in (0, 1], got ", spec.beta));
  }
  return absl::OkStatus();
}

ErrorFeedback::ErrorFeedback(const FeedbackSpec& spec, size_t n,
                             uint32_t block_elems)
    : spec_(spec), size_(n), block_elems_(block_elems) {
  MORSE_CHECK(ValidateFeedbackSpec(spec).ok());
  MORSE_CHECK(block_elems > 0 && block_elems % 16 == 0);
  if (spec.kind == FeedbackKind::kNone) return;
  if (spec.storage == ErrorStorage::kFp32) {
    fp32_.assign(n, 0.0f);
  } else {
    int8_.assign(n, 0);
    scales_.assign((n + block_elems - 1) / block_elems, 0.0f);
  }
}

absl::Status ErrorFeedback::Compress(const CodecSpec& codec, size_t offset,
                                     absl::Span<const float> x,
                                     const RoundingKey& key,
                                     absl::Span<uint8_t> payload,
                                     absl::Span<const float> mask_v) {
  if (offset % block_elems_ != 0 || offset > size_ ||
      x.size() > size_ - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("error feedback range [", offset, ", ", offset + x.size(),
                     ") is not block-aligned inside a buffer of ", size_));
  }
  if (!mask_v.empty()) {
    if (mask_v.size() != x.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a mask of ", mask_v.size(), " values for ", x.size(), " elements"));
    }
    // sign1 masks in its encode pass (where the error is fp32 or none),
    // whether or not any element is masked: no pass looks for zeros first.
    // Other codecs and int8-stored errors encode masked copies.
    if (codec.kind == CodecKind::kSign1 &&
        (spec_.kind == FeedbackKind::kNone ||
         spec_.storage == ErrorStorage::kFp32)) {
      const FeedbackArgs fb{spec_.kind, spec_.beta};
      return EncodeWithError(
          codec, x,
          spec_.kind == FeedbackKind::kNone
              ? absl::Span<float>()
              : absl::MakeSpan(fp32_).subspan(offset, x.size()),
          fb, key, payload, mask_v);
    }
    if (std::find(mask_v.begin(), mask_v.end(), 0.0f) != mask_v.end()) {
      return CompressMasked(codec, offset, x, key, payload, mask_v);
    }
  }
  const FeedbackArgs fb{spec_.kind, spec_.beta};
  if (spec_.kind == FeedbackKind::kNone) {
    return EncodeWithError(codec, x, {}, fb, key, payload);
  }
  if (spec_.storage == ErrorStorage::kFp32) {
    return EncodeWithError(codec, x,
                           absl::MakeSpan(fp32_).subspan(offset, x.size()), fb,
                           key, payload);
  }
  const absl::Span<float> error = Scratch(ScratchSlot::kErrorCopy, x.size());
  Read(offset, error);
  absl::Status status = EncodeWithError(codec, x, error, fb, key, payload);
  if (status.ok()) Quantize(offset, error);
  return status;
}

absl::Status ErrorFeedback::CompressOrKeep(const CodecSpec& codec,
                                           size_t offset,
                                           absl::Span<const float> x,
                                           const RoundingKey& key,
                                           absl::Span<uint8_t> payload,
                                           absl::Span<const float> mask_v) {
  const bool in_place = spec_.kind != FeedbackKind::kNone &&
                        spec_.storage == ErrorStorage::kFp32 &&
                        offset % block_elems_ == 0 && offset <= size_ &&
                        x.size() <= size_ - offset;
  if (!in_place) return Compress(codec, offset, x, key, payload, mask_v);
  // Reused per thread: a shard compresses a partition (1 MiB of floats by
  // default) per step, and a fresh allocation of that size would be mapped
  // and faulted in every time.
  thread_local std::vector<float> backup;
  backup.assign(fp32_.begin() + offset, fp32_.begin() + offset + x.size());
  absl::Status status = Compress(codec, offset, x, key, payload, mask_v);
  if (!status.ok())
    std::copy(backup.begin(), backup.end(), fp32_.begin() + offset);
  return status;
}

// u = mask ⊙ (x + e), e = mask ⊙ (u - C(u)): masked x and e enter as +0
// (so u is +0 there), and the masked error leaves as +0.
absl::Status ErrorFeedback::CompressMasked(const CodecSpec& codec,
                                           size_t offset,
                                           absl::Span<const float> x,
                                           const RoundingKey& key,
                                           absl::Span<uint8_t> payload,
                                           absl::Span<const float> mask_v) {
  // Each copy is masked on its way (one pass each, written so that the
  // compiler vectorizes it: a select, no branch).
  const absl::Span<float> masked = Scratch(ScratchSlot::kMaskedInput, x.size());
  SelectByZero(mask_v, x, masked);
  const FeedbackArgs fb{spec_.kind, spec_.beta};
  if (spec_.kind == FeedbackKind::kNone)
    return EncodeWithError(codec, masked, {}, fb, key, payload);
  const absl::Span<float> error = Scratch(ScratchSlot::kErrorCopy, x.size());
  if (spec_.storage == ErrorStorage::kFp32) {
    SelectByZero(mask_v, absl::MakeConstSpan(fp32_).subspan(offset, x.size()),
                 error);
  } else {
    Read(offset, error);
    SelectByZero(mask_v, error, error);
  }
  absl::Status status = EncodeWithError(codec, masked, error, fb, key, payload);
  if (!status.ok()) return status;  // the stored error stays as it was
  if (spec_.storage == ErrorStorage::kFp32) {
    SelectByZero(mask_v, error,
                 absl::MakeSpan(fp32_).subspan(offset, x.size()));
  } else {
    SelectByZero(mask_v, error, error);
    Quantize(offset, error);
  }
  return status;
}

void ErrorFeedback::SelectByZero(absl::Span<const float> mask_v,
                                 absl::Span<const float> in,
                                 absl::Span<float> out) {
  const float* __restrict m = mask_v.data();
  const float* i = in.data();
  float* o = out.data();
  for (size_t j = 0; j < out.size(); ++j) o[j] = m[j] == 0.0f ? 0.0f : i[j];
}

void ErrorFeedback::Quantize(size_t offset, absl::Span<const float> error) {
  for (size_t start = 0; start < error.size(); start += block_elems_) {
    const size_t len = simd::MinSize(block_elems_, error.size() - start);
    float amax = 0.0f;
    for (size_t j = 0; j < len; ++j)
      amax = std::fmax(amax, std::fabs(error[start + j]));
    const float s = amax / 127.0f;
    scales_[(offset + start) / block_elems_] = s;
    for (size_t j = 0; j < len; ++j) {
      const float q =
          s == 0.0f
              ? 0.0f
              : simd::ClampQ(std::nearbyint(error[start + j] / s), 127.0f);
      int8_[offset + start + j] = static_cast<int8_t>(q);
    }
  }
}

void ErrorFeedback::Read(size_t offset, absl::Span<float> out) const {
  MORSE_CHECK(offset <= size_ && out.size() <= size_ - offset);
  if (spec_.kind == FeedbackKind::kNone) {
    std::fill(out.begin(), out.end(), 0.0f);
  } else if (spec_.storage == ErrorStorage::kFp32) {
    std::copy_n(fp32_.begin() + offset, out.size(), out.begin());
  } else {
    for (size_t j = 0; j < out.size(); ++j) {
      const size_t i = offset + j;
      out[j] = static_cast<float>(int8_[i]) * scales_[i / block_elems_];
    }
  }
}

absl::Status ErrorFeedback::Restore(absl::Span<const float> error) {
  if (error.size() != size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("error buffer of ", error.size(),
                     " elements restored into one of ", size_));
  }
  for (size_t j = 0; j < error.size(); ++j) {
    if (!std::isfinite(error[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat("restored error element ", j, " is not finite"));
    }
  }
  if (spec_.kind == FeedbackKind::kNone) return absl::OkStatus();
  if (spec_.storage == ErrorStorage::kFp32) {
    fp32_.assign(error.begin(), error.end());
  } else {
    Quantize(0, error);
  }
  return absl::OkStatus();
}

absl::Status ErrorFeedback::RestoreRange(size_t offset,
                                         absl::Span<const float> error) {
  const size_t end = offset + error.size();
  if (offset % block_elems_ != 0 || offset > size_ ||
      error.size() > size_ - offset ||
      (end != size_ && end % block_elems_ != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "error range [", offset, ", ", end, ") of a buffer of ", size_,
        " elements is not block-aligned (block_elems ", block_elems_, ")"));
  }
  for (size_t j = 0; j < error.size(); ++j) {
    if (!std::isfinite(error[j])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "restored error element ", offset + j, " is not finite"));
    }
  }
  if (spec_.kind == FeedbackKind::kNone) return absl::OkStatus();
  if (spec_.storage == ErrorStorage::kFp32) {
    std::copy(error.begin(), error.end(), fp32_.begin() + offset);
  } else {
    Quantize(offset, error);
  }
  return absl::OkStatus();
}

double ErrorFeedback::SquaredNorm() const {
  double sum = 0.0;
  std::vector<float> block(block_elems_);
  for (size_t start = 0; start < size_; start += block_elems_) {
    const size_t len = simd::MinSize(block_elems_, size_ - start);
    Read(start, absl::MakeSpan(block.data(), len));
    for (size_t j = 0; j < len; ++j) sum += double{block[j]} * block[j];
  }
  return sum;
}

}  // namespace morse::compress
