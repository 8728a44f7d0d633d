// One error macro for the CUDA runtime (internal to kernels/): turns a
// cudaError_t into an absl::Status naming the call, and clears the sticky
// last error so that a later, unrelated check does not report it again.
#ifndef MORSE_KERNELS_CUDA_STATUS_H_
#define MORSE_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace morse::kernels {

inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();  // clear it
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace morse::kernels

#define MORSE_CUDA_RETURN_IF_ERROR(expr)                 \
  do {                                                   \
    if (absl::Status _morse_cuda_status =                \
            ::morse::kernels::CudaStatus((expr), #expr); \
        !_morse_cuda_status.ok()) {                      \
      return _morse_cuda_status;                         \
    }                                                    \
  } while (0)

#endif  // MORSE_KERNELS_CUDA_STATUS_H_
