// Gradient clipping by the global L2 norm (design.md 2.6): the sum of
// squares in the one order every replica, shard and engine follows, and
// torch's clip factor; the norms of order 1 and infinity a worker's own clip
// may take of the averaged gradient. Which steps clip what:
// compress/step_plan.h's ClipsAverage and ClipsLocally.
#ifndef MORSE_COMPRESS_CLIPPING_H_
#define MORSE_COMPRESS_CLIPPING_H_

#include <cstdint>

#include "absl/types/span.h"

namespace morse::compress {

// The sum of squares of `values` in double, in one fixed order that a GPU
// can follow (design.md 2.6): segments of kSumSegment elements added in
// order from 0, each segment's squares (+0 past its end) added by halving,
// t[i] = t[i] + t[i + h] for i < h, h = kSumSegment/2, ..., 1
// (compress/halving_sum.h). Every replica, shard and engine gets the same
// bits.
double GradientSumOfSquares(absl::Span<const float> values);
// One segment's sum (n <= kSumSegment), as above.
double SegmentSumOfSquares(const float* values, uint64_t n);
// torch's clip_grad_norm_ factor: min(1, max_norm / (sqrt(sum_of_squares) +
// 1e-6)) in float; 1 when max_norm is 0.
float ClipScale(double sum_of_squares, float max_norm);

// The norms of order 1 and infinity of `values` (torch's clip_grad_norm_
// with norm_type 1 and inf), which a worker's own clip takes of the averaged
// gradient (design.md 2.6): the sum of |v| in double, in one fixed order
// (element i added to lane i % kNormLanes in index order, then the lanes in
// order), and the largest |v|; both NaN when a value is NaN (as torch's).
inline constexpr uint64_t kNormLanes = 8;
struct OtherNorms {
  double sum_abs = 0.0;
  float max_abs = 0.0f;
};
OtherNorms GradientOtherNorms(absl::Span<const float> values);

// GradientSumOfSquares and GradientOtherNorms of `values` in one pass (a
// shard's decoded reply when the workers clip), with the same bits as each.
struct GradientNorms {
  double sum_of_squares = 0.0;
  OtherNorms other;
};
GradientNorms AllGradientNorms(absl::Span<const float> values);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_CLIPPING_H_
