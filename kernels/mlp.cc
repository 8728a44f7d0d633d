#include "kernels/mlp.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/launch.h"

namespace morse::kernels {
namespace {

cudaStream_t StreamOf(Context& ctx) {
  return static_cast<cudaStream_t>(ctx.stream());
}

// cuBLAS's counterpart of MORSE_CUDA_RETURN_IF_ERROR's conversion (cuBLAS
// keeps no sticky error).
absl::Status BlasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cublasGetStatusString(status));
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return absl::FailedPreconditionError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Blas>> Blas::Create(Context& ctx) {
  std::unique_ptr<Blas> blas(new Blas());
  cublasHandle_t handle = nullptr;
  if (absl::Status s = BlasStatus(cublasCreate(&handle), "cublasCreate");
      !s.ok()) {
    return s;
  }
  blas->handle_ = handle;
  if (absl::Status s =
          BlasStatus(cublasSetStream(handle, StreamOf(ctx)), "cublasSetStream");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = BlasStatus(
          cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
      !s.ok()) {
    return s;
  }
  return blas;
}

Blas::~Blas() {
  if (handle_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

absl::Status Blas::Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                        const float* a, int lda, const float* b, int ldb,
                        float beta, float* c, int ldc) {
  const float one = 1.0f;
  return BlasStatus(cublasSgemm(static_cast<cublasHandle_t>(handle_),
                                trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                                &one, a, lda, b, ldb, &beta, c, ldc),
                    "cublasSgemm");
}

absl::Status BroadcastRows(Context& ctx, const float* bias, int rows, int cols,
                           float* out) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::BroadcastRows(bias, static_cast<size_t>(rows),
                            static_cast<size_t>(cols), out, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status Relu(Context& ctx, float* z, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::Relu(z, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status ReluBackward(Context& ctx, const float* a, float* da, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::ReluBackward(a, da, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::StatusOr<double> SoftmaxCrossEntropy(Context& ctx, const float* logits,
                                           const uint32_t* labels, int rows,
                                           int classes, float* dz,
                                           double* row_loss) {
  if (rows <= 0) return 0.0;
  cudaStream_t stream = StreamOf(ctx);
  MORSE_CUDA_RETURN_IF_ERROR(launch::SoftmaxCrossEntropy(
      logits, labels, rows, classes, dz, row_loss, stream));
  std::vector<double> host(static_cast<size_t>(rows));
  MORSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), row_loss,
                                             host.size() * sizeof(double),
                                             cudaMemcpyDeviceToHost, stream));
  if (absl::Status s = ctx.Synchronize(); !s.ok()) return s;
  double loss = 0.0;
  for (double l : host) loss += l;
  return loss;
}

absl::Status ColumnSums(Context& ctx, const float* in, int rows, int cols,
                        float* out) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::ColumnSums(in, rows, cols, out, StreamOf(ctx)));
  return absl::OkStatus();
}

}  // namespace morse::kernels
