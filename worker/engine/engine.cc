#include "worker/engine/engine.h"

#include "absl/strings/str_cat.h"
#include "worker/engine/host/engine.h"
#ifdef MORSE_HAVE_CUDA
#include "worker/engine/cuda/engine.h"
#endif

namespace morse::worker {

absl::StatusOr<double> Engine::Gradient(int64_t step) {
  if (hook_ == nullptr) return absl::FailedPreconditionError("no workload was set (SetWorkload)");
  return hook_->Gradient(step, x(), grad());
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const std::string& kind,
                                                     const EngineState& state,
                                                     DeviceArrays arrays) {
  if (kind == "cpu") {
    if (arrays.x != nullptr || arrays.grad != nullptr) {
      return absl::InvalidArgumentError("the cpu engine takes no device arrays");
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
  return absl::InvalidArgumentError(absl::StrCat("no engine '", kind, "' (cpu or cuda)"));
}

absl::StatusOr<std::string> DescribeCuda() {
#ifdef MORSE_HAVE_CUDA
  return cuda::Describe();
#else
  return absl::FailedPreconditionError(
      "this build has no CUDA kernels (nvcc was not found, or -DMORSE_ENABLE_CUDA=OFF)");
#endif
}

}  // namespace morse::worker
