// The mlp workload's element-wise kernels (kernels/mlp.h): the same
// operations as worker/mlp_backprop.cc's HostMlpOps, explicitly rounded.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

__global__ void BroadcastRowsKernel(const float* __restrict__ bias, size_t cols,
                                    size_t n, float* __restrict__ out) {
  MORSE_FOR_EACH_ELEMENT(j, n) { out[j] = bias[j % cols]; }
}

__global__ void ReluKernel(float* __restrict__ z, size_t n) {
  // std::max(z, 0.0f) keeps z unless z < 0 (NaN and -0 stay).
  MORSE_FOR_EACH_ELEMENT(j, n) {
    if (z[j] < 0.0f) z[j] = 0.0f;
  }
}

__global__ void ReluBackwardKernel(const float* __restrict__ a,
                                   float* __restrict__ da, size_t n) {
  MORSE_FOR_EACH_ELEMENT(j, n) {
    if (a[j] <= 0.0f) da[j] = 0.0f;
  }
}

// One thread per row; classes is small (tens).
__global__ void SoftmaxCrossEntropyKernel(const float* __restrict__ logits,
                                          const uint32_t* __restrict__ labels,
                                          int rows, int classes,
                                          float* __restrict__ dz,
                                          double* __restrict__ row_loss) {
  MORSE_FOR_EACH_ELEMENT(r, static_cast<size_t>(rows)) {
    const float* z = logits + r * classes;
    float* d = dz + r * classes;
    float zmax = z[0];
    for (int c = 1; c < classes; ++c) {
      if (zmax < z[c]) zmax = z[c];  // std::max_element's first maximum
    }
    double sum = 0.0;
    for (int c = 0; c < classes; ++c) {
      sum = __dadd_rn(sum, exp(__dsub_rn(static_cast<double>(z[c]), zmax)));
    }
    for (int c = 0; c < classes; ++c) {
      const double p =
          __ddiv_rn(exp(__dsub_rn(static_cast<double>(z[c]), zmax)), sum);
      const double y = static_cast<uint32_t>(c) == labels[r] ? 1.0 : 0.0;
      d[c] = static_cast<float>(__ddiv_rn(__dsub_rn(p, y), rows));
    }
    row_loss[r] = -__dsub_rn(__dsub_rn(static_cast<double>(z[labels[r]]), zmax),
                             log(sum));
  }
}

// One thread per column, rows added in order (as the CPU's loop).
__global__ void ColumnSumsKernel(const float* __restrict__ in, int rows,
                                 int cols, float* __restrict__ out) {
  MORSE_FOR_EACH_ELEMENT(c, static_cast<size_t>(cols)) {
    float sum = 0.0f;
    for (int r = 0; r < rows; ++r)
      sum = Add(sum, in[r * static_cast<size_t>(cols) + c]);
    out[c] = sum;
  }
}

}  // namespace

cudaError_t BroadcastRows(const float* bias, size_t rows, size_t cols,
                          float* out, cudaStream_t stream) {
  const size_t n = rows * cols;
  BroadcastRowsKernel<<<ElementGrid(n), kThreads, 0, stream>>>(bias, cols, n,
                                                               out);
  return cudaGetLastError();
}

cudaError_t Relu(float* z, size_t n, cudaStream_t stream) {
  ReluKernel<<<ElementGrid(n), kThreads, 0, stream>>>(z, n);
  return cudaGetLastError();
}

cudaError_t ReluBackward(const float* a, float* da, size_t n,
                         cudaStream_t stream) {
  ReluBackwardKernel<<<ElementGrid(n), kThreads, 0, stream>>>(a, da, n);
  return cudaGetLastError();
}

cudaError_t SoftmaxCrossEntropy(const float* logits, const uint32_t* labels,
                                int rows, int classes, float* dz,
                                double* row_loss, cudaStream_t stream) {
  SoftmaxCrossEntropyKernel<<<ElementGrid(rows), kThreads, 0, stream>>>(
      logits, labels, rows, classes, dz, row_loss);
  return cudaGetLastError();
}

cudaError_t ColumnSums(const float* in, int rows, int cols, float* out,
                       cudaStream_t stream) {
  ColumnSumsKernel<<<ElementGrid(cols), kThreads, 0, stream>>>(in, rows, cols,
                                                               out);
  return cudaGetLastError();
}

}  // namespace morse::kernels::launch
