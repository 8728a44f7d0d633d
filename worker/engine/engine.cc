#include "worker/engine/engine.h"

#include "absl/strings/str_cat.h"
#include "worker/engine/host/engine.h"
#ifdef MORSE_HAVE_CUDA
#include "worker/engine/cuda/engine.h"
#endif

namespace morse::worker {

absl::StatusOr<double> Engine::Gradient(int64_t step) {
  if (hook_ == nullptr)
    return absl::FailedPreconditionError("no workload was set (SetWorkload)");
  return hook_->Gradient(step, x(), grad());
}

absl::Status GradientHook::GradientRange(int64_t, const float*, float*,
                                         uint64_t, uint64_t, double[4]) {
  return absl::UnimplementedError("this gradient is computed whole");
}

bool Engine::ComputesGradientRanges() const {
  return hook_ != nullptr && hook_->ComputesRanges();
}

absl::Status Engine::GradientRange(int64_t step, uint64_t begin, uint64_t end,
                                   double loss_lanes[4]) {
  if (hook_ == nullptr)
    return absl::FailedPreconditionError("no workload was set (SetWorkload)");
  if (begin > end || end > x_dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient range [", begin, ", ", end, ") of ", x_dim()));
  }
  return hook_->GradientRange(step, x(), grad(), begin, end, loss_lanes);
}

double Engine::GradientRangeLoss(const double loss_lanes[4]) {
  return GradientHook::MeanLoss(loss_lanes, x_dim());
}

absl::StatusOr<Engine::PendingEncode> Engine::StartEncode(
    int64_t step, uint32_t rank, const compress::Partition& p, float grad_scale,
    const compress::StepHyper* hyper) {
  std::optional<compress::StepHyper> own;
  if (hyper != nullptr) own = *hyper;
  return PendingEncode(
      [this, step, rank, &p, grad_scale, own](std::string* payload) {
        return Encode(step, rank, p, payload, grad_scale,
                      own.has_value() ? &*own : nullptr);
      });
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const std::string& kind,
                                                     const EngineState& state,
                                                     DeviceArrays arrays) {
  if (kind == "cpu") {
    if (arrays.x != nullptr || arrays.grad != nullptr) {
      return absl::InvalidArgumentError(
          "the cpu engine takes no device arrays");
    }
    return host::CreateEngine(state);
  }
  if (kind == "cuda") {
#ifdef MORSE_HAVE_CUDA
    return cuda::CreateEngine(state, arrays);
#else
    return DescribeCuda().status();
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no engine '", kind, "' (cpu or cuda)"));
}

absl::StatusOr<std::string> DescribeCuda() {
#ifdef MORSE_HAVE_CUDA
  return cuda::Describe();
#else
  return absl::FailedPreconditionError(
      "this build has no CUDA kernels (nvcc was not found, or "
      "-DMORSE_ENABLE_CUDA=OFF)");
#endif
}

}  // namespace morse::worker
