#include "compress/stochastic_rounding.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

// Philox streams of the synthetic workload, apart from the codecs' (which
// use steps, not these tags, in the counter's step word).
constexpr uint32_t kCurvatureTag = 0xC0FFEE01u;
constexpr uint32_t kTargetTag = 0xC0FFEE02u;

// The gradient on an engine's device: a and t copied there once.
class DeviceSyntheticHook final : public GradientHook {
 public:
  DeviceSyntheticHook(DeviceServices& device, uint64_t seed, uint32_t rank, float noise,
                      uint32_t dead_every, const float* a, const float* t, size_t n)
      : device_(device), seed_(seed), rank_(rank), noise_(noise), dead_every_(dead_every), a_(a), t_(t),
        n_(n) {}
  absl::StatusOr<double> Gradient(int64_t step, const float* x, float* grad) override {
    return device_.SyntheticGradient(seed_, step, rank_, noise_, dead_every_, a_, t_, x, grad, n_);
  }

 private:
  DeviceServices& device_;
  uint64_t seed_;
  uint32_t rank_;
  float noise_;
  uint32_t dead_every_;
  const float *a_, *t_;
  size_t n_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientHook>> SyntheticWorkload::GradientOn(Engine& engine) {
  DeviceServices* device = engine.device();
  if (device == nullptr) return Workload::GradientOn(engine);
  const float* arrays[2];
  const std::vector<float>* sources[2] = {&curvature_, &target_};
  for (int i = 0; i < 2; ++i) {
    auto memory = device->Allocate(4 * dim());
    if (!memory.ok()) return memory.status();
    if (absl::Status s = device->CopyIn(*memory, sources[i]->data(), 4 * dim()); !s.ok()) return s;
    arrays[i] = static_cast<const float*>(*memory);
  }
  return std::make_unique<DeviceSyntheticHook>(*device, seed_, rank_, noise_, dead_every_, arrays[0],
                                               arrays[1], dim());
}

SyntheticWorkload::SyntheticWorkload(const proto::JobSpec& job, uint32_t rank)
    : seed_(job.algorithm.seed),
      rank_(rank),
      noise_(job.synthetic.noise),
      dead_every_(job.synthetic.dead_every),
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
  // grad = a * (x - t) + noise * (2u - 1), u the Philox draw of (step, rank);
  // +0 for the dead elements.
  compress::FillDraws({seed_, static_cast<uint64_t>(step), rank_, 0}, grad.data(), grad.size());
  double loss = 0.0;
  for (uint64_t j = 0; j < dim(); ++j) {
    const float d = x[j] - target_[j];
    const bool dead = dead_every_ != 0 && j % dead_every_ == 0;
    grad[j] = dead ? 0.0f : curvature_[j] * d + noise_ * (2.0f * grad[j] - 1.0f);
    loss += 0.5 * double{curvature_[j]} * double{d} * double{d};
  }
  return loss / static_cast<double>(dim());
}

}  // namespace morse::worker
