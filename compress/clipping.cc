#include "compress/clipping.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/halving_sum.h"

namespace morse::compress {

double SegmentSumOfSquares(const float* values, uint64_t n) {
  MORSE_CHECK(n <= kSumSegment);
  double t[kSumSegment];
  // The squares, +0 past the end. A whole segment's loop has a constant
  // count, which the compiler vectorizes at -O2 (a loop of n it leaves
  // scalar): the same bits, one square per element either way.
  if (n == kSumSegment) {
    for (uint64_t j = 0; j < kSumSegment; ++j)
      t[j] = static_cast<double>(values[j]) * values[j];
  } else {
    for (uint64_t j = 0; j < kSumSegment; ++j)
      t[j] = j < n ? static_cast<double>(values[j]) * values[j] : 0.0;
  }
  return HalvingSum(t);
}

double GradientSumOfSquares(absl::Span<const float> values) {
  double sum = 0.0;
  for (uint64_t at = 0; at < values.size(); at += kSumSegment) {
    sum += SegmentSumOfSquares(
        values.data() + at,
        std::min<uint64_t>(kSumSegment, values.size() - at));
  }
  return sum;
}

float ClipScale(double sum_of_squares, float max_norm) {
  if (!(max_norm > 0.0f)) return 1.0f;
  const double coefficient =
      static_cast<double>(max_norm) / (std::sqrt(sum_of_squares) + 1e-6);
  return coefficient < 1.0 ? static_cast<float>(coefficient) : 1.0f;
}

absl::Status ValidateClipPieces(absl::Span<const ClipPiece> pieces,
                                uint64_t dim) {
  if (pieces.empty()) return absl::OkStatus();
  uint64_t previous = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ClipPiece& piece = pieces[i];
    if (piece.end <= previous || piece.end > dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "clip piece ", i, " ends at ", piece.end, ": the ends must rise ",
          "strictly from 0 to the model's size ", dim));
    }
    if (!std::isfinite(piece.scale)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "clip piece ", i, "'s scale ", piece.scale, ": a finite factor"));
    }
    previous = piece.end;
  }
  if (previous != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("the clip pieces end at ", previous,
                     "; the last must end at the model's size ", dim));
  }
  return absl::OkStatus();
}

bool SameClipPieces(absl::Span<const ClipPiece> a,
                    absl::Span<const ClipPiece> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].end != b[i].end ||
        std::memcmp(&a[i].scale, &b[i].scale, sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

ClipPieces ClipPiecesOf(absl::Span<const ClipPiece> pieces, uint64_t begin,
                        uint64_t end) {
  ClipPieces out;
  for (const ClipPiece& piece : pieces) {
    if (piece.end <= begin) continue;
    out.push_back({std::min(piece.end, end) - begin, piece.scale});
    if (piece.end >= end) break;
  }
  return out;
}

void ScaleByPieces(absl::Span<const ClipPiece> pieces, uint64_t at,
                   absl::Span<float> values) {
  uint64_t start = 0;  // of the piece
  const uint64_t stop = at + values.size();
  for (const ClipPiece& piece : pieces) {
    const uint64_t lo = std::max(start, at), hi = std::min(piece.end, stop);
    if (lo < hi && piece.scale != 1.0f) {
      for (uint64_t j = lo; j < hi; ++j) values[j - at] *= piece.scale;
    }
    if (piece.end >= stop) return;
    start = piece.end;
  }
}

namespace {

// kNormLanes running sums and maxima of |v|, element i in lane i %
// kNormLanes: one fixed order, without one long chain of dependent
// additions. Add takes the values in index order, each run but the last a
// multiple of kNormLanes long, so the lanes see the same elements however
// the values are cut.
class NormLanes {
 public:
  void Add(const float* values, uint64_t n) {
    uint64_t i = 0;
    for (; i + kNormLanes <= n; i += kNormLanes) {
      for (uint64_t j = 0; j < kNormLanes; ++j) {
        const float a = std::fabs(values[i + j]);
        sums_[j] += a;
        largest_[j] = std::max(largest_[j], a);
      }
    }
    for (uint64_t j = 0; i < n; ++i, ++j) {
      const float a = std::fabs(values[i]);
      sums_[j] += a;
      largest_[j] = std::max(largest_[j], a);
    }
  }

  OtherNorms Finish() const {
    OtherNorms norms;
    for (uint64_t j = 0; j < kNormLanes; ++j) {
      norms.sum_abs += sums_[j];
      norms.max_abs = std::max(norms.max_abs, largest_[j]);
    }
    // A NaN makes its lane's sum NaN; std::max may have dropped it.
    if (std::isnan(norms.sum_abs)) norms.max_abs = std::nanf("");
    return norms;
  }

 private:
  double sums_[kNormLanes] = {};
  float largest_[kNormLanes] = {};
};
static_assert(kSumSegment % kNormLanes == 0,
              "AllGradientNorms feeds the lanes a segment at a time");

}  // namespace

OtherNorms GradientOtherNorms(absl::Span<const float> values) {
  NormLanes lanes;
  lanes.Add(values.data(), values.size());
  return lanes.Finish();
}

GradientNorms AllGradientNorms(absl::Span<const float> values) {
  // A segment at a time, while it is in cache: its squares, then its |v|.
  GradientNorms norms;
  NormLanes lanes;
  for (uint64_t at = 0; at < values.size(); at += kSumSegment) {
    const uint64_t n = std::min<uint64_t>(kSumSegment, values.size() - at);
    norms.sum_of_squares += SegmentSumOfSquares(values.data() + at, n);
    lanes.Add(values.data() + at, n);
  }
  norms.other = lanes.Finish();
  return norms;
}

}  // namespace morse::compress
