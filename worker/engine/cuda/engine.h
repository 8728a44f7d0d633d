// The CUDA engine (worker/engine/engine.h): x, m, v, the error buffer and
// the gradient in GPU memory (x and the gradient may be the caller's, e.g.
// PyTorch tensors). Each partition is encoded on the GPU and copied out
// through a pinned buffer while earlier partitions are in flight; replies
// are validated on the host (they arrived there), copied in through a
// pinned buffer on a second stream and applied by fused kernels. The only
// bytes that cross PCIe in a step are the payloads and the replies (and a
// workload's batch). Every entry point selects the device the engine was
// created on, so gRPC threads apply replies on the right GPU. Encoding and
// updates are bit-identical to the host engine (kernels/codecs.h).
#ifndef MORSE_WORKER_ENGINE_CUDA_ENGINE_H_
#define MORSE_WORKER_ENGINE_CUDA_ENGINE_H_

#include <memory>
#include <string>

#include "worker/engine/engine.h"

namespace morse::worker::cuda {

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineState& state,
                                                     DeviceArrays arrays);
// "NVIDIA H100 80GB HBM3 (sm_90, 79 GiB)" for the calling thread's device,
// or FAILED_PRECONDITION saying why there is none.
absl::StatusOr<std::string> Describe();

}  // namespace morse::worker::cuda

#endif  // MORSE_WORKER_ENGINE_CUDA_ENGINE_H_
