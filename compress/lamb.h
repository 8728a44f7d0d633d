// onebit_lamb's math: 1-bit LAMB (Li et al. 2021), design.md 2.8. Its
// exchange is 1-bit Adam's; what LAMB adds is a layer rule
// (compress/layers.h), which optimizers/onebit_lamb.cc assembles from the
// loops here. A reply moves m, v and the fresh variance v' (LambMoments); a
// segment's statistics are [sum x^2, sum u^2, 0] in the warmup and
// [sum u^2, sum p^2, max d/d'] in compression (LambSegmentSums); a layer's
// totals give its commit, [coefficient, coeff_freeze, last_factor] after
// the step (LambLayerCommit); the commit moves x (LambMoveX).
//
// The element formulas are plain fp32 loops (no FMA contraction): the same
// bits on every replica.
#ifndef MORSE_COMPRESS_LAMB_H_
#define MORSE_COMPRESS_LAMB_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"

namespace morse::compress {

struct ReplyRule;

// Per segment, piece and layer, kLambStats doubles of statistics; per layer
// a commit holds kLambCommit: [coefficient, coeff_freeze, last_factor]
// after the step.
inline constexpr int kLambStats = 3;
inline constexpr int kLambCommit = 3;

// The moments of a lamb reply rule (PlanReply) from the decoded values
// (masked first when the rule masks: +0 where v is 0): warmup, m = b1*m +
// (1-b1)*g and v = b2*v + (1-b2)*g*g, and at the last warmup step v' = v;
// compression, g' = (c - b1*m)/(1-b1), v' = b2*v' + (1-b2)*g'*g', m = c.
void LambMoments(const ReplyRule& rule, absl::Span<const float> decoded,
                 absl::Span<float> m, absl::Span<float> v,
                 absl::Span<float> v_fresh);

// One segment's statistics (kLambStats values: two sums and a maximum) from
// its n <= kLayerSegment elements: the terms padded with +0 to kLayerSegment,
// then t[i] += t[i + h] for i < h, h = 128, 64, ..., 1, in double; the
// maximum ignores NaN (and is at least 0).
void LambSegmentSums(const ReplyRule& rule, const float* x, const float* m,
                     const float* v, const float* v_fresh, uint64_t n,
                     double out[kLambStats]);
// One layer's commit (kLambCommit values) from its kLambStats totals, its
// state before the step and its segment's rule.
void LambLayerCommit(const LambSpec& spec, const ReplyRule& rule,
                     const double totals[kLambStats], LambLayerState state,
                     double out[kLambCommit]);

// INVALID_ARGUMENT unless layer `layer`'s kLambCommit values are each a
// finite float that is not negative.
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
// layer in turn (checkpoints, FetchPartition, the layer rule's state).
std::vector<float> FlattenLambLayers(absl::Span<const LambLayerState> layers);

// Each layer's step lr * c_l in fp32 (what LambMoveX moves x by, per unit
// of u; the CUDA engine's).
std::vector<float> LambLayerSteps(const ReplyRule& rule,
                                  absl::Span<const double> commit);

// x = x - (lr * c_l) * u over n elements of one layer, `commit` its
// kLambCommit values.
void LambMoveX(const ReplyRule& rule, const double* commit, float* x,
               const float* m, const float* v, uint64_t n);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_LAMB_H_
