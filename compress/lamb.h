// onebit_lamb: 1-bit LAMB (Li et al. 2021), design.md 2.8. The exchange is
// 1-bit Adam's (compress/replica.h's PlanSend): full-precision averaged
// gradients in the warmup, sign-packed momentum with error feedback on both
// sides after the freeze. What LAMB adds happens on every replica after a
// step's replies: a coefficient per layer (parameter tensor) from sums over
// the whole layer, which may span partitions and shards.
//
// So a step of onebit_lamb applies in two halves. The reply of a partition
// updates m, v and the fresh variance v' at once (ApplyRule with a lamb
// rule). Then the step's per-layer totals (LambTotals, over the whole model
// in partition order) give its commit (LambCommit: each layer's coefficient
// and its state after the step), and the commit moves x (LambUpdateX). A
// worker holds the whole model and computes the commit itself; a shard's
// mirror holds one range, so rank 0 sends it the commit (ShardCore::Commit)
// and every next push carries it too, as for gradient clipping.
//
// Sums are in double, in a fixed order; the element formulas are plain fp32
// loops (no FMA contraction): the same bits on every replica.
#ifndef MORSE_COMPRESS_LAMB_H_
#define MORSE_COMPRESS_LAMB_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/halving_sum.h"
#include "compress/layout.h"

namespace morse::compress {

struct ReplyRule;

// Per layer, LambTotals gives kLambStats doubles and a commit holds
// kLambCommit: [coefficient, coeff_freeze, last_factor] after the step.
inline constexpr int kLambStats = 3;
inline constexpr int kLambCommit = 3;

// The first element of every layer, then D (config.layers, or one layer).
std::vector<uint64_t> LayerBounds(const AlgorithmConfig& config);
// How many layers: config.layers.size(), or 1.
size_t LayerCount(const AlgorithmConfig& config);

// The moments of a lamb reply rule (PlanReply) from the decoded values
// (masked first when the rule masks: +0 where v is 0): warmup, m = b1*m +
// (1-b1)*g and v = b2*v + (1-b2)*g*g, and at the last warmup step v' = v;
// compression, g' = (c - b1*m)/(1-b1), v' = b2*v' + (1-b2)*g'*g', m = c.
void LambMoments(const ReplyRule& rule, absl::Span<const float> decoded,
                 absl::Span<float> m, absl::Span<float> v,
                 absl::Span<float> v_fresh);

// The per-layer statistics of the step of `rules` (PlanReplies: one for
// the model, or one per segment, each partition taking its segment's) over
// the partitions of `layout` that lie in `range` (all of them for a
// worker), in partition order; the arrays hold `range`. Warmup: [sum x^2,
// sum u^2, 0]; compression: [sum u^2, sum p^2, max d/d'] (design.md 2.8).
//
// The order of the sums is part of the algorithm, and one a GPU can follow:
// a layer's total adds its pieces (the part of it in one partition) in
// partition order; a piece adds its segments (kLambSegment elements from the
// piece's start, the last one shorter) in order; a segment adds its terms
// by a fixed tree (LambSegmentSums). A CUDA CTA per segment gives the same
// bits.
std::vector<double> LambTotals(const AlgorithmConfig& config,
                               const Layout& layout,
                               absl::Span<const ReplyRule> rules, Range range,
                               absl::Span<const float> x,
                               absl::Span<const float> m,
                               absl::Span<const float> v,
                               absl::Span<const float> v_fresh);

// LambTotals in its parts, for engines that compute the segments elsewhere.
inline constexpr uint64_t kLambSegment = kSumSegment;
// One layer's part in one partition: global elements [begin, end).
struct LambPiece {
  uint64_t begin = 0, end = 0;
  uint32_t layer = 0;
  uint64_t segments() const {
    return (end - begin + kLambSegment - 1) / kLambSegment;
  }
};
// The pieces of the partitions of `layout` inside `range`, in partition
// order, then element order.
std::vector<LambPiece> LambPieces(const AlgorithmConfig& config,
                                  const Layout& layout, Range range);
// The pieces of one partition's range: the range cut at the layer bounds.
std::vector<LambPiece> LambPiecesOf(const AlgorithmConfig& config,
                                    Range partition);
// The statistics of every segment of `pieces`, in order (kLambStats values
// each, LambSegmentSums); the arrays hold `held`, which holds the pieces.
std::vector<double> LambSegmentsOf(const ReplyRule& rule,
                                   absl::Span<const LambPiece> pieces,
                                   Range held, absl::Span<const float> x,
                                   absl::Span<const float> m,
                                   absl::Span<const float> v,
                                   absl::Span<const float> v_fresh);
// One segment's statistics (kLambStats values: two sums and a maximum) from
// its n <= kLambSegment elements: the terms padded with +0 to kLambSegment,
// then t[i] += t[i + h] for i < h, h = 128, 64, ..., 1, in double; the
// maximum ignores NaN (and is at least 0).
void LambSegmentSums(const ReplyRule& rule, const float* x, const float* m,
                     const float* v, const float* v_fresh, uint64_t n,
                     double out[kLambStats]);
// The totals from every piece's segments (kLambStats values each, pieces in
// the order of LambPieces): each piece's segments added in order from 0,
// then the piece added to its layer's total. The two halves below.
std::vector<double> LambTotalsOfSegments(const AlgorithmConfig& config,
                                         absl::Span<const LambPiece> pieces,
                                         absl::Span<const double> segments);
// Each piece's statistics (kLambStats values a piece, in the order of
// `pieces`) from its segments': the sums added in order from 0, the
// maximum taken from 0. A shard sends these with each reply (PushReply
// `lamb_pieces`), computed on its mirror, so that workers add them alone.
std::vector<double> LambPieceSums(absl::Span<const LambPiece> pieces,
                                  absl::Span<const double> segments);
// The totals from every piece's statistics (LambPieceSums, pieces in the
// order of LambPieces), each piece added to its layer's total in order.
std::vector<double> LambTotalsOfPieces(const AlgorithmConfig& config,
                                       absl::Span<const LambPiece> pieces,
                                       absl::Span<const double> piece_sums);

// The step's commit from its totals and the layers' state before the step;
// each layer takes the rule of its segment among `rules` (PlanReplies).
std::vector<double> LambCommit(const AlgorithmConfig& config,
                               absl::Span<const ReplyRule> rules,
                               absl::Span<const double> totals,
                               absl::Span<const LambLayerState> state);
// One layer's part of LambCommit (kLambCommit values) from its kLambStats
// totals, its state before the step and its segment's rule.
void LambLayerCommit(const LambSpec& spec, const ReplyRule& rule,
                     const double totals[kLambStats], LambLayerState state,
                     double out[kLambCommit]);

// The segment of the layout (parameter group) that holds each layer.
// INVALID_ARGUMENT unless every segment starts on a layer (a layer in two
// groups would take two learning rates).
absl::StatusOr<std::vector<uint32_t>> LayerSegments(
    const AlgorithmConfig& config);

// INVALID_ARGUMENT unless `commit` has kLambCommit values per layer, each
// a finite float that is not negative.
absl::Status ValidateLambCommit(const AlgorithmConfig& config,
                                absl::Span<const double> commit);
// The same for layer `layer`'s kLambCommit values alone.
absl::Status ValidateLambLayerCommit(size_t layer,
                                     absl::Span<const double> values);

// INVALID_ARGUMENT unless a saved run's v' (of any part of the model) is
// finite and not negative and its flattened layer state (FlattenLambLayers)
// is finite; `what` starts the message ("the saved state of partition 3").
absl::Status ValidateSavedLamb(absl::Span<const float> v_fresh,
                               absl::Span<const float> layers,
                               absl::string_view what);

// The layers' state after the step of `commit`.
std::vector<LambLayerState> LambStateOf(absl::Span<const double> commit);

// Every layer's state as floats, coeff_freeze then last_factor of each
// layer in turn (checkpoints, FetchPartition), and back.
std::vector<float> FlattenLambLayers(absl::Span<const LambLayerState> layers);
std::vector<LambLayerState> UnflattenLambLayers(absl::Span<const float> values);

// Each layer's step lr * c_l in fp32 (what LambUpdateX moves x by, per
// unit of u).
std::vector<float> LambLayerSteps(const ReplyRule& rule,
                                  absl::Span<const double> commit);

// x = x - (lr * c_l) * u over global elements [begin, begin + n), arrays
// holding `range`.
void LambUpdateX(const AlgorithmConfig& config, const ReplyRule& rule,
                 absl::Span<const double> commit, Range range, uint64_t begin,
                 uint64_t n, absl::Span<float> x, absl::Span<const float> m,
                 absl::Span<const float> v);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_LAMB_H_
