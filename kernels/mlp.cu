// The mlp workload's element-wise kernels (kernels/mlp.h): the same
// operations as worker/mlp_backprop.cc's HostMlpOps, explicitly rounded.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
using namespace device;

cudaError_t BroadcastRows(const float* bias, size_t rows, size_t cols,
                          float* out, cudaStream_t stream) {
  return ForEachElement(rows * cols, stream,
                        [=] __device__(size_t j) { out[j] = bias[j % cols]; });
}

cudaError_t Relu(float* z, size_t n, cudaStream_t stream) {
  // std::max(z, 0.0f) keeps z unless z < 0 (NaN and -0 stay).
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    if (z[j] < 0.0f) z[j] = 0.0f;
  });
}

cudaError_t ReluBackward(const float* a, float* da, size_t n,
                         cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    if (a[j] <= 0.0f) da[j] = 0.0f;
  });
}

// One thread per row; classes is small (tens).
cudaError_t SoftmaxCrossEntropy(const float* logits, const uint32_t* labels,
                                int rows, int classes, float* dz,
                                double* row_loss, cudaStream_t stream) {
  return ForEachElement(
      static_cast<size_t>(rows), stream, [=] __device__(size_t r) {
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
        row_loss[r] = -__dsub_rn(
            __dsub_rn(static_cast<double>(z[labels[r]]), zmax), log(sum));
      });
}

// One thread per column, rows added in order (as the CPU's loop).
cudaError_t ColumnSums(const float* in, int rows, int cols, float* out,
                       cudaStream_t stream) {
  return ForEachElement(
      static_cast<size_t>(cols), stream, [=] __device__(size_t c) {
        float sum = 0.0f;
        for (int r = 0; r < rows; ++r)
          sum = Add(sum, in[r * static_cast<size_t>(cols) + c]);
        out[c] = sum;
      });
}

}  // namespace morse::kernels::launch
