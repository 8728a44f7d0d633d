#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "compress/kernels.h"
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
  DeviceSyntheticHook(DeviceServices& device, uint64_t seed, uint32_t rank,
                      float noise, uint32_t dead_every, const float* a,
                      const float* t, size_t n)
      : device_(device),
        seed_(seed),
        rank_(rank),
        noise_(noise),
        dead_every_(dead_every),
        a_(a),
        t_(t),
        n_(n) {}
  absl::StatusOr<double> Gradient(int64_t step, const float* x,
                                  float* grad) override {
    return device_.SyntheticGradient(seed_, step, rank_, noise_, dead_every_,
                                     a_, t_, x, grad, n_);
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

absl::StatusOr<std::unique_ptr<GradientHook>> SyntheticWorkload::GradientOn(
    Engine& engine) {
  DeviceServices* device = engine.device();
  if (device == nullptr) return Workload::GradientOn(engine);
  const float* arrays[2];
  const std::vector<float>* sources[2] = {curvature_.get(), target_.get()};
  for (int i = 0; i < 2; ++i) {
    auto memory = device->Allocate(4 * dim());
    if (!memory.ok()) return memory.status();
    if (absl::Status s = device->CopyIn(*memory, sources[i]->data(), 4 * dim());
        !s.ok())
      return s;
    arrays[i] = static_cast<const float*>(*memory);
  }
  return std::make_unique<DeviceSyntheticHook>(
      *device, seed_, rank_, noise_, dead_every_, arrays[0], arrays[1], dim());
}

SyntheticWorkload::SyntheticWorkload(const proto::JobSpec& job, uint32_t rank)
    : seed_(job.algorithm.seed),
      rank_(rank),
      noise_(job.synthetic.noise),
      dead_every_(job.synthetic.dead_every) {
  const uint64_t n = job.synthetic.dim;
  auto curvature = std::make_shared<std::vector<float>>(n);
  auto target = std::make_shared<std::vector<float>>(n);
  compress::FillDraws({seed_, kCurvatureTag, kCurvatureTag, 0},
                      curvature->data(), n);
  compress::FillDraws({seed_, kTargetTag, kTargetTag, 0}, target->data(), n);
  for (uint64_t j = 0; j < n; ++j) {
    (*curvature)[j] = 0.1f + 0.9f * (*curvature)[j];
    (*target)[j] = 2.0f * (*target)[j] - 1.0f;
  }
  curvature_ = std::move(curvature);
  target_ = std::move(target);
}

SyntheticWorkload::SyntheticWorkload(const SyntheticWorkload& same_job,
                                     uint32_t rank)
    : seed_(same_job.seed_),
      rank_(rank),
      noise_(same_job.noise_),
      dead_every_(same_job.dead_every_),
      curvature_(same_job.curvature_),
      target_(same_job.target_) {}

void SyntheticWorkload::Initialize(absl::Span<float> x) const {
  std::fill(x.begin(), x.end(), 0.0f);
}

absl::StatusOr<double> SyntheticWorkload::Gradient(int64_t step,
                                                   absl::Span<const float> x,
                                                   absl::Span<float> grad) {
  double lanes[4] = {0, 0, 0, 0};
  if (absl::Status s = GradientRange(step, x, grad, 0, dim(), lanes); !s.ok())
    return s;
  return GradientHook::MeanLoss(lanes, dim());
}

absl::Status SyntheticWorkload::GradientRange(int64_t step,
                                              absl::Span<const float> x,
                                              absl::Span<float> grad,
                                              uint64_t begin, uint64_t end,
                                              double loss_lanes[4]) {
  // grad = a * (x - t) + noise * (2u - 1), u the Philox draw of (step,
  // rank); +0 for the dead elements. A chunk at a time: its draws stay in
  // L1 (the vector generator, compress::KernelTable::fill_draws), and the
  // loss goes to four lanes so that its additions do not wait on each other.
  if (begin > end || end > dim() || x.size() != dim() || grad.size() != dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient range [", begin, ", ", end, ") of ", dim()));
  }
  constexpr uint64_t kChunk = 1024;
  double lanes[4] = {loss_lanes[0], loss_lanes[1], loss_lanes[2],
                     loss_lanes[3]};
  alignas(64) float draws[kChunk];
  const compress::KernelTable& kernels = compress::ActiveKernels();
  const float* __restrict a = curvature_->data();
  const float* __restrict t = target_->data();
  const float* __restrict xs = x.data();
  float* __restrict g = grad.data();
  const float noise = noise_;
  for (uint64_t start = begin; start < end; start += kChunk) {
    const uint64_t len = std::min(kChunk, end - start);
    kernels.fill_draws({seed_, static_cast<uint64_t>(step), rank_, start},
                       draws, len);
    for (uint64_t i = 0; i < len; ++i) {
      const uint64_t j = start + i;
      g[j] = a[j] * (xs[j] - t[j]) + noise * (2.0f * draws[i] - 1.0f);
    }
    if (dead_every_ != 0) {
      for (uint64_t j = (start + dead_every_ - 1) / dead_every_ * dead_every_;
           j < start + len; j += dead_every_) {
        g[j] = 0.0f;
      }
    }
    const auto term = [&](uint64_t j) {
      const float d = xs[j] - t[j];
      return 0.5 * double{a[j]} * double{d} * double{d};
    };
    uint64_t j = start;
    for (; j % 4 != 0 && j < start + len; ++j) lanes[j % 4] += term(j);
    for (; j + 4 <= start + len; j += 4) {
      lanes[0] += term(j);
      lanes[1] += term(j + 1);
      lanes[2] += term(j + 2);
      lanes[3] += term(j + 3);
    }
    for (; j < start + len; ++j) lanes[j % 4] += term(j);
  }
  for (int l = 0; l < 4; ++l) loss_lanes[l] = lanes[l];
  return absl::OkStatus();
}

}  // namespace morse::worker
