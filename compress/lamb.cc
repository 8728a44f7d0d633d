#include "compress/lamb.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/replica.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {
namespace {

// One element's update direction u = p + wd*x, with p = m̂/(sqrt(v̂)+eps)
// (bounded from the freeze on); *p and *ratio (d/d', compression only) for
// the statistics.
inline float UpdateDirection(const ReplyRule& rule, float x, float m, float v, float v_fresh, float* p,
                       float* ratio) {
  const AdamScalars& s = rule.scalars;
  const float m_hat = m / s.bias_correction1;
  const float d = std::sqrt(v / s.bias_correction2) + s.eps;
  float q = m_hat / d;
  if (rule.frozen_variance) {
    q = simd::BoundRatio(q, s.max_ratio);
    if (ratio != nullptr) *ratio = d / (std::sqrt(v_fresh / rule.fresh_correction2) + s.eps);
  }
  if (p != nullptr) *p = q;
  return q + s.weight_decay * x;
}

// The layer of global element `at`: the last bound <= at.
size_t LayerOf(absl::Span<const uint64_t> bounds, uint64_t at) {
  return static_cast<size_t>(std::upper_bound(bounds.begin(), bounds.end(), at) - bounds.begin()) - 1;
}

}  // namespace

std::vector<uint64_t> LayerBounds(const SimulatorConfig& config) {
  std::vector<uint64_t> bounds{0};
  for (uint64_t size : config.layers) bounds.push_back(bounds.back() + size);
  if (config.layers.empty()) bounds.push_back(config.layout.dim);
  return bounds;
}

size_t LayerCount(const SimulatorConfig& config) { return std::max<size_t>(1, config.layers.size()); }

void LambMoments(const ReplyRule& rule, absl::Span<const float> decoded, absl::Span<float> m,
                 absl::Span<float> v, absl::Span<float> v_fresh) {
  MORSE_CHECK(decoded.size() == m.size() && m.size() == v.size() && v.size() == v_fresh.size());
  const float b1 = rule.scalars.beta1, b2 = rule.scalars.beta2;
  if (!rule.frozen_variance) {
    for (size_t j = 0; j < m.size(); ++j) {
      const float g = decoded[j];
      m[j] = b1 * m[j] + (1.0f - b1) * g;
      v[j] = b2 * v[j] + (1.0f - b2) * (g * g);
      if (rule.copy_fresh) v_fresh[j] = v[j];
    }
    return;
  }
  for (size_t j = 0; j < m.size(); ++j) {
    const float c = decoded[j];
    const float g = (c - b1 * m[j]) / (1.0f - b1);
    v_fresh[j] = b2 * v_fresh[j] + (1.0f - b2) * (g * g);
    m[j] = c;
  }
}

std::vector<double> LambTotals(const SimulatorConfig& config, const Layout& layout,
                               const ReplyRule& rule, Range range, absl::Span<const float> x,
                               absl::Span<const float> m, absl::Span<const float> v,
                               absl::Span<const float> v_fresh) {
  MORSE_CHECK(x.size() == range.size() && m.size() == x.size() && v.size() == x.size() &&
              v_fresh.size() == x.size());
  const std::vector<uint64_t> bounds = LayerBounds(config);
  std::vector<double> totals(kLambStats * (bounds.size() - 1), 0.0);
  for (const Partition& p : layout.partitions()) {
    if (p.range.begin < range.begin || p.range.end > range.end) continue;
    // Each piece of a layer in this partition: its sums in element order,
    // added to the layer's in partition order.
    for (uint64_t at = p.range.begin; at < p.range.end;) {
      const size_t l = LayerOf(bounds, at);
      const uint64_t end = std::min(p.range.end, bounds[l + 1]);
      double a = 0, b = 0;
      float most = 0.0f;
      for (uint64_t g = at; g < end; ++g) {
        const size_t j = g - range.begin;
        float q = 0.0f, ratio = 0.0f;
        const float u = UpdateDirection(rule, x[j], m[j], v[j], v_fresh[j], &q, &ratio);
        if (rule.frozen_variance) {
          a += static_cast<double>(u) * u;
          b += static_cast<double>(q) * q;
          most = std::max(most, ratio);
        } else {
          a += static_cast<double>(x[j]) * x[j];
          b += static_cast<double>(u) * u;
        }
      }
      totals[kLambStats * l] += a;
      totals[kLambStats * l + 1] += b;
      totals[kLambStats * l + 2] = std::max(totals[kLambStats * l + 2], static_cast<double>(most));
      at = end;
    }
  }
  return totals;
}

std::vector<double> LambCommit(const SimulatorConfig& config, const ReplyRule& rule,
                               absl::Span<const double> totals, absl::Span<const LambLayerState> state) {
  const LambSpec& spec = config.lamb;
  const size_t layers = state.size();
  MORSE_CHECK(totals.size() == kLambStats * layers);
  std::vector<double> commit(kLambCommit * layers);
  for (size_t l = 0; l < layers; ++l) {
    const double* t = &totals[kLambStats * l];
    float coefficient = 1.0f;
    LambLayerState next = state[l];
    if (!rule.frozen_variance) {
      // LAMB: the trust ratio ||x|| / ||u||, clamped; 1 where either is 0.
      if (t[0] > 0 && t[1] > 0) {
        const double r = std::clamp(std::sqrt(t[0]) / std::sqrt(t[1]), double{spec.min_coeff},
                                    double{spec.max_coeff});
        coefficient = static_cast<float>(r);
        next.coeff_freeze = static_cast<float>(double{spec.coeff_beta} * next.coeff_freeze +
                                               (1.0 - double{spec.coeff_beta}) * coefficient);
      }
    } else {
      // 1-bit LAMB: how much larger the frozen denominator is than the
      // fresh one, at most; with weight decay, weighed by the share of the
      // update that is not decay.
      double factor = t[2];
      if (rule.scalars.weight_decay > 0.0f) {
        const double share = t[0] > 0 ? std::min(1.0, std::sqrt(t[1]) / std::sqrt(t[0])) : 1.0;
        factor = factor * share + (1.0 - share);
      }
      factor = std::clamp(factor, double{spec.factor_min}, double{spec.factor_max});
      const double last = next.last_factor;
      factor = std::clamp(factor, last * (1.0 - double{spec.factor_threshold}),
                          last * (1.0 + double{spec.factor_threshold}));
      next.last_factor = static_cast<float>(factor);
      coefficient = static_cast<float>(double{next.coeff_freeze} * next.last_factor);
    }
    commit[kLambCommit * l] = coefficient;
    commit[kLambCommit * l + 1] = next.coeff_freeze;
    commit[kLambCommit * l + 2] = next.last_factor;
  }
  return commit;
}

absl::Status ValidateLambCommit(const SimulatorConfig& config, absl::Span<const double> commit) {
  const size_t layers = LayerCount(config);
  if (commit.size() != kLambCommit * layers) {
    return absl::InvalidArgumentError(absl::StrCat("a onebit_lamb commit has ", kLambCommit,
                                                   " values for each of the model's ", layers,
                                                   " layers, got ", commit.size()));
  }
  for (size_t i = 0; i < commit.size(); ++i) {
    const double value = commit[i];
    if (!std::isfinite(value) || value < 0 || static_cast<double>(static_cast<float>(value)) != value) {
      return absl::InvalidArgumentError(absl::StrCat("onebit_lamb commit value ", i, " (", value,
                                                     ") must be a finite float, not negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSavedLamb(absl::Span<const float> v_fresh, absl::Span<const float> layers,
                               absl::string_view what) {
  for (float f : v_fresh) {
    if (!std::isfinite(f) || f < 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": v' holds a negative, Inf or NaN"));
    }
  }
  for (float f : layers) {
    if (!std::isfinite(f)) return absl::InvalidArgumentError(absl::StrCat(what, ": the layer state holds Inf or NaN"));
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

std::vector<LambLayerState> UnflattenLambLayers(absl::Span<const float> values) {
  std::vector<LambLayerState> layers(values.size() / 2);
  for (size_t l = 0; l < layers.size(); ++l) layers[l] = {values[2 * l], values[2 * l + 1]};
  return layers;
}

void LambUpdateX(const SimulatorConfig& config, const ReplyRule& rule, absl::Span<const double> commit,
                 Range range, uint64_t begin, uint64_t n, absl::Span<float> x, absl::Span<const float> m,
                 absl::Span<const float> v) {
  MORSE_CHECK(begin >= range.begin && begin + n <= range.end && x.size() == range.size() &&
              m.size() == x.size() && v.size() == x.size());
  const std::vector<uint64_t> bounds = LayerBounds(config);
  for (uint64_t at = begin; at < begin + n;) {
    const size_t l = LayerOf(bounds, at);
    const uint64_t end = std::min(begin + n, bounds[l + 1]);
    const float step = rule.scalars.lr * static_cast<float>(commit[kLambCommit * l]);
    for (uint64_t g = at; g < end; ++g) {
      const size_t j = g - range.begin;
      x[j] = x[j] - step * UpdateDirection(rule, x[j], m[j], v[j], 0.0f, nullptr, nullptr);
    }
    at = end;
  }
}

}  // namespace morse::compress
