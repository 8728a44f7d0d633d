#include "worker/inner_adam.h"

#include <algorithm>

#include "compress/check.h"
#include "compress/update_rules.h"

namespace morse::worker {

InnerAdam::InnerAdam(const compress::AlgorithmConfig& config, uint64_t dim)
    : config_(config),
      schedule_(config.lr),
      x_(dim),
      m_(dim, 0.0f),
      v_(dim, 0.0f),
      grad_(dim) {
  // The job's steps are outer steps; the schedule runs over inner ones.
  schedule_.total_steps *= config.diloco.sync_every;
}

absl::StatusOr<double> InnerAdam::Run(int64_t step, Workload& workload,
                                      absl::Span<const float> outer,
                                      absl::Span<float> pseudo_gradient) {
  MORSE_CHECK(outer.size() == x_.size() && pseudo_gradient.size() == x_.size());
  std::copy(outer.begin(), outer.end(), x_.begin());
  const int64_t every = config_.diloco.sync_every;
  double loss = 0;
  for (int64_t h = 0; h < every; ++h) {
    const int64_t inner = step * every + h;
    auto l = workload.Gradient(inner, x_, absl::MakeSpan(grad_));
    if (!l.ok()) return l.status();
    loss += *l;
    const compress::AdamScalars s = compress::MakeAdamScalars(
        config_.adam, compress::LearningRate(schedule_, inner), inner + 1,
        config_.bias_correction);
    compress::AdamStep(s, grad_, absl::MakeSpan(x_), absl::MakeSpan(m_),
                       absl::MakeSpan(v_));
  }
  for (size_t j = 0; j < x_.size(); ++j) pseudo_gradient[j] = outer[j] - x_[j];
  return loss / static_cast<double>(every);
}

}  // namespace morse::worker
