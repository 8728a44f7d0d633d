// The mlp workload's array operations on the GPU (what worker/mlp_backprop.h
// calls MlpOps), in host-only C++: matrix products through cuBLAS, the rest
// as kernels. Every pointer is device memory; every function enqueues on the
// context's stream. The element-wise operations and the column sums give the
// CPU's floats exactly; cuBLAS sums its products in an order of its own, so
// the gradient agrees with the CPU's only to rounding (and a GPU worker's
// batches are the CPU worker's batches, so the two train the same model up
// to that rounding).
#ifndef MORSE_KERNELS_MLP_H_
#define MORSE_KERNELS_MLP_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/device.h"

namespace morse::kernels {

// A cuBLAS handle whose work goes on one context's stream, in plain fp32
// (CUBLAS_DEFAULT_MATH: no TF32 or other reduced-precision shortcuts).
class Blas {
 public:
  static absl::StatusOr<std::unique_ptr<Blas>> Create(Context& ctx);
  ~Blas();

  // Column-major, as cublasSgemm: c (m x n, leading dimension ldc) =
  // op(a) * op(b) + beta * c. Asynchronous.
  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                    const float* a, int lda, const float* b, int ldb,
                    float beta, float* c, int ldc);

 private:
  Blas() = default;
  void* handle_ = nullptr;  // a cublasHandle_t
};

// Every row of out (rows x cols, row-major) = bias. Asynchronous.
absl::Status BroadcastRows(Context& ctx, const float* bias, int rows, int cols,
                           float* out);
// z = max(z, 0), as std::max(z, 0.0f). Asynchronous.
absl::Status Relu(Context& ctx, float* z, size_t n);
// da = 0 where a <= 0. Asynchronous.
absl::Status ReluBackward(Context& ctx, const float* a, float* da, size_t n);
// Softmax cross-entropy of each row of logits (rows x classes) against its
// label (each < classes): dz = (p - onehot) / rows, computed in double as on
// the CPU. Each row's loss goes to row_loss (rows doubles of device memory);
// returns their sum, added on the host in row order. Waits for the stream.
absl::StatusOr<double> SoftmaxCrossEntropy(Context& ctx, const float* logits,
                                           const uint32_t* labels, int rows,
                                           int classes, float* dz,
                                           double* row_loss);
// out (cols) = the sum of the rows of in (rows x cols), added in row order.
// Asynchronous.
absl::Status ColumnSums(Context& ctx, const float* in, int rows, int cols,
                        float* out);

}  // namespace morse::kernels

#endif  // MORSE_KERNELS_MLP_H_
