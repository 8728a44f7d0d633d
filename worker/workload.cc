#include "worker/workload.h"

#include "absl/strings/str_cat.h"

namespace morse::worker {
namespace {

// A workload's CPU gradient, for the host engine.
class HostHook final : public GradientHook {
 public:
  explicit HostHook(Workload& workload) : workload_(workload) {}
  absl::StatusOr<double> Gradient(int64_t step, const float* x,
                                  float* grad) override {
    const uint64_t n = workload_.dim();
    return workload_.Gradient(step, absl::MakeConstSpan(x, n),
                              absl::MakeSpan(grad, n));
  }
  bool ComputesRanges() const override { return workload_.ComputesRanges(); }
  absl::Status GradientRange(int64_t step, const float* x, float* grad,
                             uint64_t begin, uint64_t end,
                             double loss_lanes[4]) override {
    const uint64_t n = workload_.dim();
    return workload_.GradientRange(step, absl::MakeConstSpan(x, n),
                                   absl::MakeSpan(grad, n), begin, end,
                                   loss_lanes);
  }

 private:
  Workload& workload_;
};

}  // namespace

absl::Status Workload::GradientRange(int64_t, absl::Span<const float>,
                                     absl::Span<float>, uint64_t, uint64_t,
                                     double[4]) {
  return absl::UnimplementedError("this workload computes its gradient whole");
}

absl::StatusOr<std::unique_ptr<GradientHook>> Workload::GradientOn(
    Engine& engine) {
  if (engine.device() == nullptr) return std::make_unique<HostHook>(*this);
  return absl::UnimplementedError(
      absl::StrCat("this workload has no gradient on ", engine.kind()));
}

// Defined beside the workloads (engine/ does not include them): the engine
// keeps the hook the workload builds for it.
absl::Status Engine::SetWorkload(Workload& workload) {
  if (workload.dim() != x_dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a workload of ", workload.dim(),
                     " parameters for a model of ", x_dim()));
  }
  auto hook = workload.GradientOn(*this);
  if (!hook.ok()) return hook.status();
  hook_ = *std::move(hook);
  return absl::OkStatus();
}

}  // namespace morse::worker
