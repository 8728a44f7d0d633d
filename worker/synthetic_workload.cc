#include "compress/stochastic_rounding.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

// Philox streams of the synthetic workload, apart from the codecs' (which
// use steps, not these tags, in the counter's step word).
constexpr uint32_t kCurvatureTag = 0xC0FFEE01u;
constexpr uint32_t kTargetTag = 0xC0FFEE02u;

}  // namespace

SyntheticWorkload::SyntheticWorkload(const proto::JobSpec& job, uint32_t rank)
    : seed_(job.algorithm.seed),
      rank_(rank),
      noise_(job.synthetic.noise),
      curvature_(job.synthetic.dim),
      target_(job.synthetic.dim) {
  compress::FillDraws({seed_, kCurvatureTag, kCurvatureTag, 0}, curvature_.data(), dim());
  compress::FillDraws({seed_, kTargetTag, kTargetTag, 0}, target_.data(), dim());
  for (uint64_t j = 0; j < dim(); ++j) {
    curvature_[j] = 0.1f + 0.9f * curvature_[j];
    target_[j] = 2.0f * target_[j] - 1.0f;
  }
}

void SyntheticWorkload::Initialize(absl::Span<float> x) const {
  std::fill(x.begin(), x.end(), 0.0f);
}

absl::StatusOr<double> SyntheticWorkload::Gradient(int64_t step, absl::Span<const float> x,
                                                   absl::Span<float> grad) {
  // grad = a * (x - t) + noise * (2u - 1), u the Philox draw of (step, rank).
  compress::FillDraws({seed_, static_cast<uint64_t>(step), rank_, 0}, grad.data(), grad.size());
  double loss = 0.0;
  for (uint64_t j = 0; j < dim(); ++j) {
    const float d = x[j] - target_[j];
    grad[j] = curvature_[j] * d + noise_ * (2.0f * grad[j] - 1.0f);
    loss += 0.5 * double{curvature_[j]} * double{d} * double{d};
  }
  return loss / static_cast<double>(dim());
}

}  // namespace morse::worker
