#include "compress/update_rules.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {

absl::Status ValidateAdamHyper(const AdamHyper& h) {
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f) ||
      !(h.beta2 >= 0.0f && h.beta2 < 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adam: betas must be in [0, 1), got ", h.beta1, ", ", h.beta2));
  }
  if (!(h.eps > 0.0f) || !std::isfinite(h.eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam: eps must be positive, got ", h.eps));
  }
  if (!(h.weight_decay >= 0.0f) || !std::isfinite(h.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam: weight_decay must be >= 0, got ", h.weight_decay));
  }
  return absl::OkStatus();
}

absl::Status ValidateLrSchedule(const LrSchedule& s) {
  if (!(s.base_lr > 0.0f) || !std::isfinite(s.base_lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr: base_lr must be positive, got ", s.base_lr));
  }
  if (s.warmup_steps < 0)
    return absl::InvalidArgumentError("lr: warmup_steps must be >= 0");
  if (s.kind == LrSchedule::Kind::kCosine &&
      (s.total_steps <= s.warmup_steps || !(s.min_lr >= 0.0f) ||
       s.min_lr > s.base_lr)) {
    return absl::InvalidArgumentError(
        "lr: cosine needs total_steps > warmup_steps and 0 <= min_lr <= "
        "base_lr");
  }
  return absl::OkStatus();
}

float LearningRate(const LrSchedule& s, int64_t step) {
  const double base = s.base_lr;
  if (step < s.warmup_steps) {
    return static_cast<float>(base * static_cast<double>(step + 1) /
                              static_cast<double>(s.warmup_steps));
  }
  if (s.kind == LrSchedule::Kind::kConstant) return s.base_lr;
  const double span = static_cast<double>(s.total_steps - s.warmup_steps);
  const double done =
      std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * done));
  return static_cast<float>(s.min_lr + (base - s.min_lr) * cosine);
}

AdamScalars MakeAdamScalars(const AdamHyper& h, float lr, int64_t t,
                            bool bias_correction) {
  AdamScalars s;
  s.lr = lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.eps = h.eps;
  s.weight_decay = h.weight_decay;
  if (bias_correction) {
    MORSE_CHECK(t >= 1);
    s.bias_correction1 =
        static_cast<float>(1.0 - std::pow(double{h.beta1}, double(t)));
    s.bias_correction2 =
        static_cast<float>(1.0 - std::pow(double{h.beta2}, double(t)));
  }
  return s;
}

float OneBitUpdateBound(const AdamHyper& h) {
  const double bound =
      (1.0 - double{h.beta1}) / std::sqrt(1.0 - double{h.beta2});
  return static_cast<float>(std::max(1.0, bound));
}

void AdamStep(const AdamScalars& s, absl::Span<const float> g,
              absl::Span<float> x, absl::Span<float> m, absl::Span<float> v) {
  MORSE_CHECK(g.size() == x.size() && x.size() == m.size() &&
              m.size() == v.size());
  ActiveKernels().adam_update(s, g.data(), x.data(), m.data(), v.data(),
                              x.size());
}

void FrozenVarianceStep(const AdamScalars& s, absl::Span<const float> c,
                        absl::Span<float> x, absl::Span<float> m,
                        absl::Span<const float> v, bool mask) {
  MORSE_CHECK(c.size() == x.size() && x.size() == m.size() &&
              m.size() == v.size());
  ActiveKernels().frozen_update(s, c.data(), x.data(), m.data(), v.data(),
                                x.size(), mask);
}

void LocalMomentum(float beta1, absl::Span<const float> m,
                   absl::Span<const float> g, absl::Span<float> out) {
  MORSE_CHECK(m.size() == g.size() && g.size() == out.size());
  ActiveKernels().momentum(beta1, m.data(), g.data(), out.data(), out.size());
}

void OuterStep(const OuterScalars& s, absl::Span<const float> d,
               absl::Span<float> x, absl::Span<float> m) {
  MORSE_CHECK(d.size() == x.size() && x.size() == m.size());
  for (size_t j = 0; j < d.size(); ++j) {
    const float mj = s.momentum * m[j] + d[j];
    m[j] = mj;
    x[j] = x[j] - s.lr * (s.nesterov ? d[j] + s.momentum * mj : mj);
  }
}

void ZeroOneVarianceStep(const AdamScalars& s, absl::Span<const float> g,
                         absl::Span<float> x, absl::Span<float> m,
                         absl::Span<float> v) {
  MORSE_CHECK(g.size() == x.size() && x.size() == m.size() &&
              m.size() == v.size());
  for (size_t j = 0; j < g.size(); ++j) {
    const float mi = s.beta1 * m[j] + (1.0f - s.beta1) * g[j];
    const float vi = s.beta2 * v[j] + (1.0f - s.beta2) * (g[j] * g[j]);
    const float m_hat = mi / s.bias_correction1;
    const float v_hat = vi / s.bias_correction2;
    const float d =
        simd::BoundRatio(m_hat / (std::sqrt(v_hat) + s.eps), s.max_ratio) +
        s.weight_decay * x[j];
    m[j] = mi;
    v[j] = vi;
    x[j] = x[j] - s.lr * d;
  }
}

void ZeroOneLocalStep(const AdamScalars& s, absl::Span<const float> g,
                      absl::Span<float> x, absl::Span<float> m,
                      absl::Span<float> u, absl::Span<const float> v,
                      bool write_x, bool fresh) {
  MORSE_CHECK(g.size() == x.size() && x.size() == m.size() &&
              m.size() == u.size() && u.size() == v.size());
  ActiveKernels().zero_one_local_step(s, g.data(), x.data(), m.data(), u.data(),
                                      v.data(), g.size(), fresh, write_x);
}

void ZeroOneSyncMessage(const AdamScalars& s, float lr_sum,
                        absl::Span<const float> u, absl::Span<const float> m,
                        absl::Span<const float> v, absl::Span<float> out) {
  MORSE_CHECK(u.size() == m.size() && m.size() == v.size() &&
              v.size() == out.size());
  if (lr_sum == 0.0f) {
    std::copy(m.begin(), m.end(), out.begin());
    return;
  }
  ActiveKernels().zero_one_sync_message(s, lr_sum, u.data(), v.data(),
                                        out.data(), u.size());
}

void ZeroOneSyncLocalStep(const AdamScalars& s, const AdamScalars& sync,
                          float lr_sum, absl::Span<const float> g,
                          absl::Span<float> x, absl::Span<float> m,
                          absl::Span<float> u, absl::Span<const float> v,
                          bool fresh, absl::Span<float> out) {
  MORSE_CHECK(g.size() == x.size() && x.size() == m.size() &&
              m.size() == u.size() && u.size() == v.size() &&
              v.size() == out.size());
  if (lr_sum == 0.0f) {  // the message is m after the step: the two passes
    ZeroOneLocalStep(s, g, x, m, u, v, /*write_x=*/false, fresh);
    ZeroOneSyncMessage(sync, lr_sum, u, m, v, out);
    return;
  }
  ActiveKernels().zero_one_sync_local_step(s, sync, lr_sum, g.data(), x.data(),
                                           m.data(), u.data(), v.data(),
                                           g.size(), fresh, out.data());
}

void ZeroOneSyncStep(const AdamScalars& s, absl::Span<const float> w,
                     absl::Span<const float> anchor, absl::Span<float> x,
                     absl::Span<float> m, absl::Span<const float> v,
                     bool mask) {
  MORSE_CHECK(w.size() == anchor.size() && anchor.size() == x.size() &&
              x.size() == m.size() && m.size() == v.size());
  ActiveKernels().zero_one_sync_step(s, mask, w.data(), anchor.data(), x.data(),
                                     m.data(), v.data(), w.size());
}

}  // namespace morse::compress
