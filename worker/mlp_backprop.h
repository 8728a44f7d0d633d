// The mlp workload's forward and backward passes, written once over the few
// array operations they need (MlpOps), which the CPU (CBLAS and loops,
// HostMlpOps) and the GPU (cuBLAS and kernels/, in
// worker/engine/cuda/engine.cc) both provide. The parameter layout is the
// workload's: layer after layer, the weights (in x out, row-major) and then the
// biases (out). Activations are row-major (rows x width).
//
// Gemm takes BLAS's column-major convention, as cuBLAS does: a row-major
// buffer of r x c is a column-major c x r matrix, its transpose, so the
// row-major product C = A * B is Gemm(N, N, n, m, k, B, A, C) with the
// operands swapped (what CBLAS does itself for CblasRowMajor).
#ifndef MORSE_WORKER_MLP_BACKPROP_H_
#define MORSE_WORKER_MLP_BACKPROP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace morse::worker {

class MlpOps {
 public:
  virtual ~MlpOps() = default;
  // c (m x n, column-major, leading dimension ldc) = op(a) * op(b) + beta * c,
  // op(a) m x k, op(b) k x n.
  virtual absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                            const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc) = 0;
  // Every row of out (rows x cols) = bias (cols).
  virtual absl::Status BroadcastRows(const float* bias, int rows, int cols,
                                     float* out) = 0;
  // z = max(z, 0).
  virtual absl::Status Relu(float* z, size_t n) = 0;
  // da = 0 where a <= 0 (a is the ReLU's output).
  virtual absl::Status ReluBackward(const float* a, float* da, size_t n) = 0;
  // Softmax cross-entropy of each row of logits (rows x classes) against its
  // label: dz = (p - onehot) / rows; returns the summed loss, accumulated in
  // double row by row in order.
  virtual absl::StatusOr<double> SoftmaxCrossEntropy(const float* logits,
                                                     const uint32_t* labels,
                                                     int rows, int classes,
                                                     float* dz) = 0;
  // out (cols) = the sum of the rows of in (rows x cols), rows added in order.
  virtual absl::Status ColumnSums(const float* in, int rows, int cols,
                                  float* out) = 0;
};

// The buffers of one pass over up to `rows` rows, in the ops' memory:
// acts[0] the input (rows x widths[0]), acts[l] the output of layer l (after
// the ReLU for hidden layers; acts.back() the logits), and two buffers of
// rows x max(widths) for the backward pass.
struct MlpBuffers {
  std::vector<float*> acts;
  float* dz = nullptr;
  float* da = nullptr;
};

// The floats each buffer needs for up to `rows` rows, in the order acts[0],
// ..., acts.back(), dz, da: rows * widths[l], then rows * max(widths) twice.
std::vector<size_t> MlpBufferSizes(const std::vector<uint32_t>& widths,
                                   uint32_t rows);
// MlpBuffers over one allocation per MlpBufferSizes entry, in its order.
MlpBuffers MlpBuffersOver(const std::vector<float*>& storage);

// The forward pass at parameters x over acts[0]'s `rows` rows.
absl::Status MlpForward(MlpOps& ops, const std::vector<uint32_t>& widths,
                        const float* x, int rows, const MlpBuffers& buffers);

// Forward and backward: grad (the whole parameter vector) at x for the batch
// in acts[0] with `labels` (in the ops' memory); returns the mean loss.
absl::StatusOr<double> MlpGradient(MlpOps& ops,
                                   const std::vector<uint32_t>& widths,
                                   const float* x, const uint32_t* labels,
                                   int rows, MlpBuffers buffers, float* grad);

// MlpOps on the host: CBLAS (column-major) and plain loops.
class HostMlpOps final : public MlpOps {
 public:
  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                    const float* a, int lda, const float* b, int ldb,
                    float beta, float* c, int ldc) override;
  absl::Status BroadcastRows(const float* bias, int rows, int cols,
                             float* out) override;
  absl::Status Relu(float* z, size_t n) override;
  absl::Status ReluBackward(const float* a, float* da, size_t n) override;
  absl::StatusOr<double> SoftmaxCrossEntropy(const float* logits,
                                             const uint32_t* labels, int rows,
                                             int classes, float* dz) override;
  absl::Status ColumnSums(const float* in, int rows, int cols,
                          float* out) override;
};

// Host memory for MlpBuffers of up to `rows` rows.
class HostMlpBuffers {
 public:
  HostMlpBuffers(const std::vector<uint32_t>& widths, uint32_t rows);
  const MlpBuffers& buffers() const { return buffers_; }
  float* input() const { return buffers_.acts[0]; }
  const float* logits() const { return buffers_.acts.back(); }

 private:
  std::vector<std::vector<float>> storage_;
  MlpBuffers buffers_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_MLP_BACKPROP_H_
