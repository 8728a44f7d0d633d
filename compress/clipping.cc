#include "compress/clipping.h"

#include <algorithm>
#include <cmath>

#include "compress/check.h"
#include "compress/halving_sum.h"

namespace morse::compress {

double SegmentSumOfSquares(const float* values, uint64_t n) {
  MORSE_CHECK(n <= kSumSegment);
  double t[kSumSegment];
  for (uint64_t j = 0; j < kSumSegment; ++j)
    t[j] = j < n ? static_cast<double>(values[j]) * values[j] : 0.0;
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

OtherNorms GradientOtherNorms(absl::Span<const float> values) {
  // kNormLanes running sums and maxima, element i in lane i % kNormLanes:
  // one fixed order, without one long chain of dependent additions.
  double sums[kNormLanes] = {};
  float largest[kNormLanes] = {};
  const uint64_t n = values.size();
  uint64_t i = 0;
  for (; i + kNormLanes <= n; i += kNormLanes) {
    for (uint64_t j = 0; j < kNormLanes; ++j) {
      const float a = std::fabs(values[i + j]);
      sums[j] += a;
      largest[j] = std::max(largest[j], a);
    }
  }
  for (uint64_t j = 0; i < n; ++i, ++j) {
    const float a = std::fabs(values[i]);
    sums[j] += a;
    largest[j] = std::max(largest[j], a);
  }
  OtherNorms norms;
  for (uint64_t j = 0; j < kNormLanes; ++j) {
    norms.sum_abs += sums[j];
    norms.max_abs = std::max(norms.max_abs, largest[j]);
  }
  // A NaN makes its lane's sum NaN; std::max may have dropped it.
  if (std::isnan(norms.sum_abs)) norms.max_abs = std::nanf("");
  return norms;
}

}  // namespace morse::compress
