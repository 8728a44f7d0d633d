// DeviceModel in a build without CUDA kernels: Create says so.
#include "worker/device_model.h"

namespace morse::worker {

class DeviceModel::Impl {};

DeviceModel::DeviceModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceModel::~DeviceModel() = default;

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Create(
    const compress::SimulatorConfig&, const compress::Layout&, DeviceArrays) {
  return absl::FailedPreconditionError(
      "this build has no CUDA kernels (nvcc was not found, or "
      "-DMORSE_ENABLE_CUDA=OFF)");
}

absl::StatusOr<std::string> DeviceModel::Describe() {
  return absl::FailedPreconditionError(
      "this build has no CUDA kernels (nvcc was not found, or "
      "-DMORSE_ENABLE_CUDA=OFF)");
}

const std::string& DeviceModel::description() const {
  static const std::string kNone = "none";
  return kNone;
}
absl::Status DeviceModel::Upload(const compress::Replica&,
                                 absl::Span<const float>) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::Download(compress::Replica&, absl::Span<float>) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::SetWorkload(Workload&) {
  return absl::FailedPreconditionError("no GPU");
}
absl::StatusOr<double> DeviceModel::Gradient(int64_t) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::DownloadGradient(absl::Span<float>) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::WaitFor(void*) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::Encode(int64_t, uint32_t, const compress::StepPlan&,
                                 const compress::Partition&, std::string*) {
  return absl::FailedPreconditionError("no GPU");
}
absl::Status DeviceModel::ApplyReply(int64_t, const compress::Partition&,
                                     absl::Span<const uint8_t>) {
  return absl::FailedPreconditionError("no GPU");
}

}  // namespace morse::worker
