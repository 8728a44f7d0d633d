// DeviceModel: a worker's x, m, v and error buffer in GPU memory, and the
// parts of a step that touch them (DESIGN 2.1-2.4 through kernels/): the
// gradient of the built-in workloads, encoding each partition into
// the bytes a push carries, and applying each reply. The only bytes that
// cross PCIe in a step are the payloads and the replies (through pinned
// buffers), and for mlp the batch; the host Replica is brought up to date
// only when asked (SyncHost: checksums, checkpoints, the end of training).
//
// Compiled from device_model_cuda.cc when the build has CUDA kernels, from
// device_model_none.cc otherwise (Create then says the build has no CUDA).
// Encoding and updates are bit-identical to the CPU path (kernels/codecs.h),
// so CPU and GPU workers can share a job and every replica stays the same;
// the synthetic gradient is too, the mlp gradient only to rounding (cuBLAS
// sums its products in its own order).
//
// Encode runs on the thread that drives the step; ApplyReply on gRPC threads,
// serialized by a mutex on a stream of its own.
#ifndef MORSE_WORKER_DEVICE_MODEL_H_
#define MORSE_WORKER_DEVICE_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/simulator.h"

namespace morse::worker {

class Workload;

// A caller's device arrays of dim floats (PyTorch tensors): the model's
// parameters live in `x` and Encode reads the gradient from `grad`. Null:
// the model allocates its own.
struct DeviceArrays {
  float* x = nullptr;
  float* grad = nullptr;
};

class DeviceModel {
 public:
  // FAILED_PRECONDITION when there is no GPU (or no CUDA in this build), with
  // the reason; UNIMPLEMENTED for settings the GPU path lacks (int8-stored
  // error buffers, topk).
  // `external`: the caller's device arrays for x and the gradient, if any.
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Create(
      const compress::SimulatorConfig& config, const compress::Layout& layout,
      DeviceArrays external = {});
  ~DeviceModel();

  // The GPU Create would use ("NVIDIA H100 ... (sm_90, 79 GiB)"), or
  // FAILED_PRECONDITION saying why there is none.
  static absl::StatusOr<std::string> Describe();

  // "NVIDIA H100 ... (sm_90, 79 GiB)".
  const std::string& description() const;

  // Host -> device: the replica's x, m, v and the error buffer (dim floats).
  absl::Status Upload(const compress::Replica& replica,
                      absl::Span<const float> error);
  // Device -> host.
  absl::Status Download(compress::Replica& replica, absl::Span<float> error);

  // The workload whose gradient Gradient computes on the device: synthetic
  // (a kernel) or mlp (cuBLAS and kernels, through worker/mlp_backprop.h;
  // the batches are drawn on the host and copied over, features and labels
  // only). Not owned; must outlive this model. UNIMPLEMENTED for others.
  absl::Status SetWorkload(Workload& workload);
  // The gradient of `step` at the device's x, into the device gradient;
  // returns the local loss.
  absl::StatusOr<double> Gradient(int64_t step);
  // Device -> host: the last Gradient's result (dim floats; tests).
  absl::Status DownloadGradient(absl::Span<float> grad);

  // The next Encode waits for the work already enqueued on `stream` (a
  // cudaStream_t of the caller's, e.g. PyTorch's current stream): the
  // gradient it reads is complete; the host does not block.
  absl::Status WaitFor(void* stream);

  // The push payload of partition `p` for `step` (plan = PlanStep(step)).
  absl::Status Encode(int64_t step, uint32_t rank,
                      const compress::StepPlan& plan,
                      const compress::Partition& p, std::string* payload);
  // Applies the reply of partition `p` for `step`; INVALID_ARGUMENT (nothing
  // changed) for a malformed reply.
  absl::Status ApplyReply(int64_t step, const compress::Partition& p,
                          absl::Span<const uint8_t> reply);

  class Impl;

 private:
  explicit DeviceModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_DEVICE_MODEL_H_
