#include "worker/workload.h"

#include "absl/strings/str_cat.h"

namespace morse::worker {
namespace {

// A workload's CPU gradient, for the host engine.
class HostHook final : public GradientHook {
 public:
  explicit HostHook(Workload& workload) : workload_(workload) {}
  absl::StatusOr<double> Gradient(int64_t step, const float* x, float* grad) override {
    const uint64_t n = workload_.dim();
    return workload_.Gradient(step, absl::MakeConstSpan(x, n), absl::MakeSpan(grad, n));
  }

 private:
  Workload& workload_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientHook>> Workload::GradientOn(Engine& engine) {
  if (engine.device() == nullptr) return std::make_unique<HostHook>(*this);
  return absl::UnimplementedError(absl::StrCat("this workload has no gradient on ", engine.kind()));
}

// Defined beside the workloads (engine/ does not include them): the engine
// keeps the hook the workload builds for it.
absl::Status Engine::SetWorkload(Workload& workload) {
  if (workload.dim() != x_dim()) {
    return absl::InvalidArgumentError(absl::StrCat("a workload of ", workload.dim(),
                                                   " parameters for a model of ", x_dim()));
  }
  auto hook = workload.GradientOn(*this);
  if (!hook.ok()) return hook.status();
  hook_ = *std::move(hook);
  return absl::OkStatus();
}

}  // namespace morse::worker
