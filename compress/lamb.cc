#include "compress/lamb.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/kernels.h"
#include "compress/layers.h"
#include "compress/step_rules.h"

namespace morse::compress {
namespace {

// The element scalars of `rule` for the kernels' LAMB loops.
LambScalars ScalarsOf(const ReplyRule& rule) {
  return {rule.scalars, rule.frozen_variance, rule.fresh_correction2};
}

}  // namespace

void LambMoments(const ReplyRule& rule, absl::Span<const float> decoded,
                 absl::Span<float> m, absl::Span<float> v,
                 absl::Span<float> v_fresh) {
  MORSE_CHECK(decoded.size() == m.size() && m.size() == v.size() &&
              v.size() == v_fresh.size());
  ActiveKernels().lamb_moments(ScalarsOf(rule), rule.copy_fresh, rule.mask,
                               decoded.data(), m.data(), v.data(),
                               v_fresh.data(), m.size());
}

void LambSegmentSums(const ReplyRule& rule, const float* x, const float* m,
                     const float* v, const float* v_fresh, uint64_t n,
                     double out[kLambStats]) {
  MORSE_CHECK(n <= kLayerSegment);
  ActiveKernels().lamb_segment_sums(ScalarsOf(rule), x, m, v, v_fresh, n, out);
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

std::vector<float> LambLayerSteps(const ReplyRule& rule,
                                  absl::Span<const double> commit) {
  std::vector<float> steps(commit.size() / kLambCommit);
  for (size_t l = 0; l < steps.size(); ++l) {
    steps[l] = rule.scalars.lr * static_cast<float>(commit[kLambCommit * l]);
  }
  return steps;
}

void LambMoveX(const ReplyRule& rule, const double* commit, float* x,
               const float* m, const float* v, uint64_t n) {
  const float step = rule.scalars.lr * static_cast<float>(commit[0]);
  ActiveKernels().lamb_update_x(ScalarsOf(rule), step, x, m, v, n);
}

}  // namespace morse::compress
