// Gradient clipping by the global L2 norm (design.md 2.6): the sum of
// squares in the one order every replica, shard and engine follows, and
// torch's clip factor; the norms of order 1 and infinity a worker's own clip
// may take of the averaged gradient. Which steps clip what:
// compress/step_plan.h's ClipsAverage and ClipsLocally.
#ifndef MORSE_COMPRESS_CLIPPING_H_
#define MORSE_COMPRESS_CLIPPING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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

// A clip of part of the model (design.md 2.6, "Clipping part of the
// model"): the workers' clip_grad_norm_ over some of the parameters, each
// clipped by its own factors (times the factor of an edit of a whole
// parameter's gradient after the clip: any finite value). The step's clip
// is then a list of pieces in element order, piece i scaling elements [end
// of piece i-1 (0 for the first), end) of the decoded average by `scale`;
// the last piece ends at the model's size.
struct ClipPiece {
  uint64_t end = 0;
  float scale = 1.0f;
};
using ClipPieces = std::vector<ClipPiece>;

// OK, or INVALID_ARGUMENT saying what is wrong, unless `pieces` is empty or
// ends strictly increase to `dim` and every scale is finite.
absl::Status ValidateClipPieces(absl::Span<const ClipPiece> pieces,
                                uint64_t dim);
// Whether two lists hold the same pieces, scales bit for bit.
bool SameClipPieces(absl::Span<const ClipPiece> a,
                    absl::Span<const ClipPiece> b);
// The pieces over global elements [begin, end), their ends made relative
// to `begin` (a partition's share of a valid list; empty for empty).
ClipPieces ClipPiecesOf(absl::Span<const ClipPiece> pieces, uint64_t begin,
                        uint64_t end);
// Multiplies values[j] by the scale of the piece that holds element j
// (pieces relative to values[0], as ClipPiecesOf gives them, covering
// at least [at, at + values.size())): one float multiplication an
// element, none where the scale is 1.
void ScaleByPieces(absl::Span<const ClipPiece> pieces, uint64_t at,
                   absl::Span<float> values);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_CLIPPING_H_
