#include "compress/lamb.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/kernels.h"
#include "compress/replica.h"
#include "compress/step_plan.h"

namespace morse::compress {
namespace {

// The element scalars of `rule` for the kernels' LAMB loops.
LambScalars ScalarsOf(const ReplyRule& rule) {
  return {rule.scalars, rule.frozen_variance, rule.fresh_correction2};
}

// The layer of global element `at`: the last bound <= at.
size_t LayerOf(absl::Span<const uint64_t> bounds, uint64_t at) {
  return static_cast<size_t>(
             std::upper_bound(bounds.begin(), bounds.end(), at) -
             bounds.begin()) -
         1;
}

}  // namespace

std::vector<uint64_t> LayerBounds(const AlgorithmConfig& config) {
  std::vector<uint64_t> bounds{0};
  for (uint64_t size : config.layers) bounds.push_back(bounds.back() + size);
  if (config.layers.empty()) bounds.push_back(config.layout.dim);
  return bounds;
}

size_t LayerCount(const AlgorithmConfig& config) {
  return std::max<size_t>(1, config.layers.size());
}

void LambMoments(const ReplyRule& rule, absl::Span<const float> decoded,
                 absl::Span<float> m, absl::Span<float> v,
                 absl::Span<float> v_fresh) {
  MORSE_CHECK(decoded.size() == m.size() && m.size() == v.size() &&
              v.size() == v_fresh.size());
  ActiveKernels().lamb_moments(ScalarsOf(rule), rule.copy_fresh, rule.mask,
                               decoded.data(), m.data(), v.data(),
                               v_fresh.data(), m.size());
}

std::vector<LambPiece> LambPiecesOf(const AlgorithmConfig& config,
                                    Range partition) {
  const std::vector<uint64_t> bounds = LayerBounds(config);
  std::vector<LambPiece> pieces;
  for (uint64_t at = partition.begin; at < partition.end;) {
    const size_t l = LayerOf(bounds, at);
    const uint64_t end = std::min(partition.end, bounds[l + 1]);
    pieces.push_back({at, end, static_cast<uint32_t>(l)});
    at = end;
  }
  return pieces;
}

std::vector<LambPiece> LambPieces(const AlgorithmConfig& config,
                                  const Layout& layout, Range range) {
  std::vector<LambPiece> pieces;
  for (const Partition& p : layout.partitions()) {
    if (p.range.begin < range.begin || p.range.end > range.end) continue;
    const std::vector<LambPiece> of = LambPiecesOf(config, p.range);
    pieces.insert(pieces.end(), of.begin(), of.end());
  }
  return pieces;
}

std::vector<double> LambSegmentsOf(const ReplyRule& rule,
                                   absl::Span<const LambPiece> pieces,
                                   Range held, absl::Span<const float> x,
                                   absl::Span<const float> m,
                                   absl::Span<const float> v,
                                   absl::Span<const float> v_fresh) {
  MORSE_CHECK(x.size() == held.size() && m.size() == x.size() &&
              v.size() == x.size() && v_fresh.size() == x.size());
  std::vector<double> segments;
  for (const LambPiece& piece : pieces) {
    MORSE_CHECK(piece.begin >= held.begin && piece.end <= held.end);
    for (uint64_t at = piece.begin; at < piece.end; at += kLambSegment) {
      const size_t j = at - held.begin;
      double out[kLambStats];
      LambSegmentSums(rule, &x[j], &m[j], &v[j], &v_fresh[j],
                      std::min(kLambSegment, piece.end - at), out);
      segments.insert(segments.end(), out, out + kLambStats);
    }
  }
  return segments;
}

void LambSegmentSums(const ReplyRule& rule, const float* x, const float* m,
                     const float* v, const float* v_fresh, uint64_t n,
                     double out[kLambStats]) {
  MORSE_CHECK(n <= kLambSegment);
  ActiveKernels().lamb_segment_sums(ScalarsOf(rule), x, m, v, v_fresh, n, out);
}

std::vector<double> LambTotalsOfSegments(const AlgorithmConfig& config,
                                         absl::Span<const LambPiece> pieces,
                                         absl::Span<const double> segments) {
  return LambTotalsOfPieces(config, pieces, LambPieceSums(pieces, segments));
}

std::vector<double> LambPieceSums(absl::Span<const LambPiece> pieces,
                                  absl::Span<const double> segments) {
  std::vector<double> sums;
  sums.reserve(kLambStats * pieces.size());
  size_t k = 0;
  for (const LambPiece& piece : pieces) {
    double a = 0, b = 0, most = 0;
    for (uint64_t s = 0; s < piece.segments(); ++s, ++k) {
      MORSE_CHECK(kLambStats * (k + 1) <= segments.size());
      const double* seg = &segments[kLambStats * k];
      a += seg[0];
      b += seg[1];
      most = seg[2] > most ? seg[2] : most;
    }
    static_assert(kLambStats == 3);
    sums.insert(sums.end(), {a, b, most});
  }
  MORSE_CHECK(kLambStats * k == segments.size());
  return sums;
}

std::vector<double> LambTotalsOfPieces(const AlgorithmConfig& config,
                                       absl::Span<const LambPiece> pieces,
                                       absl::Span<const double> piece_sums) {
  MORSE_CHECK(piece_sums.size() == kLambStats * pieces.size());
  std::vector<double> totals(kLambStats * LayerCount(config), 0.0);
  for (size_t k = 0; k < pieces.size(); ++k) {
    const double* piece = &piece_sums[kLambStats * k];
    double* total = &totals[kLambStats * pieces[k].layer];
    total[0] += piece[0];
    total[1] += piece[1];
    total[2] = piece[2] > total[2] ? piece[2] : total[2];
  }
  return totals;
}

std::vector<double> LambTotals(const AlgorithmConfig& config,
                               const Layout& layout,
                               absl::Span<const ReplyRule> rules, Range range,
                               absl::Span<const float> x,
                               absl::Span<const float> m,
                               absl::Span<const float> v,
                               absl::Span<const float> v_fresh) {
  std::vector<LambPiece> pieces;
  std::vector<double> segments;
  for (const Partition& p : layout.partitions()) {
    if (p.range.begin < range.begin || p.range.end > range.end) continue;
    const std::vector<LambPiece> of = LambPiecesOf(config, p.range);
    const std::vector<double> sums =
        LambSegmentsOf(RuleOf(rules, p.segment), of, range, x, m, v, v_fresh);
    pieces.insert(pieces.end(), of.begin(), of.end());
    segments.insert(segments.end(), sums.begin(), sums.end());
  }
  return LambTotalsOfSegments(config, pieces, segments);
}

absl::StatusOr<std::vector<uint32_t>> LayerSegments(
    const AlgorithmConfig& config) {
  const std::vector<uint64_t> bounds = LayerBounds(config);
  const std::vector<uint64_t>& cuts = config.layout.cuts;
  for (uint64_t cut : cuts) {
    const size_t l = LayerOf(bounds, cut);
    if (bounds[l] != cut) {
      return absl::InvalidArgumentError(absl::StrCat(
          "onebit_lamb's parameter groups (external.groups) must each start "
          "on a layer; the group at element ",
          cut, " starts inside layer ", l, " [", bounds[l], ", ", bounds[l + 1],
          ")"));
    }
  }
  std::vector<uint32_t> segments;
  for (size_t l = 0; l + 1 < bounds.size(); ++l) {
    segments.push_back(static_cast<uint32_t>(
        std::upper_bound(cuts.begin(), cuts.end(), bounds[l]) - cuts.begin()));
  }
  return segments;
}

void LambLayerCommit(const LambSpec& spec, const ReplyRule& rule,
                     const double t[kLambStats], LambLayerState next,
                     double out[kLambCommit]) {
  float coefficient = 1.0f;
  if (!rule.frozen_variance) {
    // LAMB: the trust ratio ||x|| / ||u||, clamped; 1 where either is 0.
    if (t[0] > 0 && t[1] > 0) {
      const double r =
          std::clamp(std::sqrt(t[0]) / std::sqrt(t[1]), double{spec.min_coeff},
                     double{spec.max_coeff});
      coefficient = static_cast<float>(r);
      next.coeff_freeze =
          static_cast<float>(double{spec.coeff_beta} * next.coeff_freeze +
                             (1.0 - double{spec.coeff_beta}) * coefficient);
    }
  } else {
    // 1-bit LAMB: how much larger the frozen denominator is than the fresh
    // one, at most; with weight decay, weighed by the share of the update
    // that is not decay.
    double factor = t[2];
    if (rule.scalars.weight_decay > 0.0f) {
      const double share =
          t[0] > 0 ? std::min(1.0, std::sqrt(t[1]) / std::sqrt(t[0])) : 1.0;
      factor = factor * share + (1.0 - share);
    }
    factor =
        std::clamp(factor, double{spec.factor_min}, double{spec.factor_max});
    const double last = next.last_factor;
    factor = std::clamp(factor, last * (1.0 - double{spec.factor_threshold}),
                        last * (1.0 + double{spec.factor_threshold}));
    next.last_factor = static_cast<float>(factor);
    coefficient =
        static_cast<float>(double{next.coeff_freeze} * next.last_factor);
  }
  out[0] = coefficient;
  out[1] = next.coeff_freeze;
  out[2] = next.last_factor;
}

std::vector<double> LambCommit(const AlgorithmConfig& config,
                               absl::Span<const ReplyRule> rules,
                               absl::Span<const double> totals,
                               absl::Span<const LambLayerState> state) {
  const size_t layers = state.size();
  MORSE_CHECK(totals.size() == kLambStats * layers);
  // Validated with the config (OneBitLamb::Validate).
  const absl::StatusOr<std::vector<uint32_t>> segment = LayerSegments(config);
  MORSE_CHECK(segment.ok() && segment->size() == layers);
  std::vector<double> commit(kLambCommit * layers);
  for (size_t l = 0; l < layers; ++l) {
    LambLayerCommit(config.lamb, RuleOf(rules, (*segment)[l]),
                    &totals[kLambStats * l], state[l],
                    &commit[kLambCommit * l]);
  }
  return commit;
}

absl::Status ValidateLambCommit(const AlgorithmConfig& config,
                                absl::Span<const double> commit) {
  const size_t layers = LayerCount(config);
  if (commit.size() != kLambCommit * layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a onebit_lamb commit has ", kLambCommit,
                     " values for each of the model's ", layers,
                     " layers, got ", commit.size()));
  }
  for (size_t l = 0; l < layers; ++l) {
    if (absl::Status s = ValidateLambLayerCommit(
            l, commit.subspan(kLambCommit * l, kLambCommit));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLambLayerCommit(size_t layer,
                                     absl::Span<const double> values) {
  MORSE_CHECK(values.size() == kLambCommit);
  for (size_t k = 0; k < values.size(); ++k) {
    const double value = values[k];
    if (!std::isfinite(value) || value < 0 ||
        static_cast<double>(static_cast<float>(value)) != value) {
      return absl::InvalidArgumentError(
          absl::StrCat("onebit_lamb commit value ", kLambCommit * layer + k,
                       " (", value, ") must be a finite float, not negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSavedLamb(absl::Span<const float> v_fresh,
                               absl::Span<const float> layers,
                               absl::string_view what) {
  for (float f : v_fresh) {
    if (!std::isfinite(f) || f < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": v' holds a negative, Inf or NaN"));
    }
  }
  for (float f : layers) {
    if (!std::isfinite(f))
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the layer state holds Inf or NaN"));
  }
  return absl::OkStatus();
}

std::vector<LambLayerState> LambStateOf(absl::Span<const double> commit) {
  std::vector<LambLayerState> state(commit.size() / kLambCommit);
  for (size_t l = 0; l < state.size(); ++l) {
    state[l].coeff_freeze = static_cast<float>(commit[kLambCommit * l + 1]);
    state[l].last_factor = static_cast<float>(commit[kLambCommit * l + 2]);
  }
  return state;
}

std::vector<float> FlattenLambLayers(absl::Span<const LambLayerState> layers) {
  std::vector<float> values;
  values.reserve(2 * layers.size());
  for (const LambLayerState& l : layers) {
    values.push_back(l.coeff_freeze);
    values.push_back(l.last_factor);
  }
  return values;
}

std::vector<LambLayerState> UnflattenLambLayers(
    absl::Span<const float> values) {
  std::vector<LambLayerState> layers(values.size() / 2);
  for (size_t l = 0; l < layers.size(); ++l)
    layers[l] = {values[2 * l], values[2 * l + 1]};
  return layers;
}

std::vector<float> LambLayerSteps(const ReplyRule& rule,
                                  absl::Span<const double> commit) {
  std::vector<float> steps(commit.size() / kLambCommit);
  for (size_t l = 0; l < steps.size(); ++l) {
    steps[l] = rule.scalars.lr * static_cast<float>(commit[kLambCommit * l]);
  }
  return steps;
}

void LambUpdateX(const AlgorithmConfig& config, const ReplyRule& rule,
                 absl::Span<const double> commit, Range range, uint64_t begin,
                 uint64_t n, absl::Span<float> x, absl::Span<const float> m,
                 absl::Span<const float> v) {
  MORSE_CHECK(begin >= range.begin && begin + n <= range.end &&
              x.size() == range.size() && m.size() == x.size() &&
              v.size() == x.size());
  const std::vector<uint64_t> bounds = LayerBounds(config);
  const std::vector<float> steps = LambLayerSteps(rule, commit);
  const LambScalars scalars = ScalarsOf(rule);
  for (uint64_t at = begin; at < begin + n;) {
    const size_t l = LayerOf(bounds, at);
    const uint64_t end = std::min(begin + n, bounds[l + 1]);
    const size_t j = at - range.begin;
    ActiveKernels().lamb_update_x(scalars, steps[l], &x[j], &m[j], &v[j],
                                  end - at);
    at = end;
  }
}

}  // namespace morse::compress
