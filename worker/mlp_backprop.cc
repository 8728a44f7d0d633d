#include "worker/mlp_backprop.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace morse::worker {

std::vector<size_t> MlpBufferSizes(const std::vector<uint32_t>& widths,
                                   uint32_t rows) {
  std::vector<size_t> sizes;
  for (uint32_t width : widths)
    sizes.push_back(static_cast<size_t>(rows) * width);
  const size_t widest = static_cast<size_t>(rows) *
                        *std::max_element(widths.begin(), widths.end());
  sizes.push_back(widest);  // dz
  sizes.push_back(widest);  // da
  return sizes;
}

MlpBuffers MlpBuffersOver(const std::vector<float*>& storage) {
  MlpBuffers buffers;
  buffers.acts.assign(storage.begin(), storage.end() - 2);
  buffers.dz = storage[storage.size() - 2];
  buffers.da = storage.back();
  return buffers;
}

absl::Status MlpForward(MlpOps& ops, const std::vector<uint32_t>& widths,
                        const float* x, int rows, const MlpBuffers& buffers) {
  size_t offset = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    const int in = static_cast<int>(widths[l]);
    const int out = static_cast<int>(widths[l + 1]);
    const float* w = x + offset;
    const float* bias = w + static_cast<size_t>(in) * out;
    float* z = buffers.acts[l + 1];
    // z = bias + a * w (row-major: rows x in times in x out).
    if (absl::Status s = ops.BroadcastRows(bias, rows, out, z); !s.ok()) {
      return s;
    }
    if (absl::Status s = ops.Gemm(false, false, out, rows, in, w, out,
                                  buffers.acts[l], in, 1.0f, z, out);
        !s.ok()) {
      return s;
    }
    if (l + 2 < widths.size()) {
      if (absl::Status s = ops.Relu(z, static_cast<size_t>(rows) * out);
          !s.ok()) {
        return s;
      }
    }
    offset += static_cast<size_t>(in) * out + out;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> MlpGradient(MlpOps& ops,
                                   const std::vector<uint32_t>& widths,
                                   const float* x, const uint32_t* labels,
                                   int rows, MlpBuffers buffers, float* grad) {
  if (absl::Status s = MlpForward(ops, widths, x, rows, buffers); !s.ok()) {
    return s;
  }
  auto loss =
      ops.SoftmaxCrossEntropy(buffers.acts.back(), labels, rows,
                              static_cast<int>(widths.back()), buffers.dz);
  if (!loss.ok()) return loss.status();
  size_t offset = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    offset += static_cast<size_t>(widths[l]) * widths[l + 1] + widths[l + 1];
  }
  for (size_t l = widths.size() - 1; l >= 1; --l) {
    const int in = static_cast<int>(widths[l - 1]);
    const int out = static_cast<int>(widths[l]);
    offset -= static_cast<size_t>(in) * out + out;
    const float* w = x + offset;
    float* dw = grad + offset;
    float* db = dw + static_cast<size_t>(in) * out;
    const float* a = buffers.acts[l - 1];
    // dw = a^T * dz (in x out), db = the column sums of dz.
    if (absl::Status s = ops.Gemm(false, true, out, in, rows, buffers.dz, out,
                                  a, in, 0.0f, dw, out);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = ops.ColumnSums(buffers.dz, rows, out, db); !s.ok()) {
      return s;
    }
    if (l == 1) break;
    // da = dz * w^T (rows x in), through the ReLU that produced a.
    if (absl::Status s = ops.Gemm(true, false, in, rows, out, w, out,
                                  buffers.dz, out, 0.0f, buffers.da, in);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            ops.ReluBackward(a, buffers.da, static_cast<size_t>(rows) * in);
        !s.ok()) {
      return s;
    }
    std::swap(buffers.dz, buffers.da);
  }
  return *loss / rows;
}

absl::Status HostMlpOps::Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                              const float* a, int lda, const float* b, int ldb,
                              float beta, float* c, int ldc) {
  cblas_sgemm(CblasColMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b,
              ldb, beta, c, ldc);
  return absl::OkStatus();
}

absl::Status HostMlpOps::BroadcastRows(const float* bias, int rows, int cols,
                                       float* out) {
  for (int r = 0; r < rows; ++r) {
    std::copy_n(bias, cols, out + static_cast<size_t>(r) * cols);
  }
  return absl::OkStatus();
}

absl::Status HostMlpOps::Relu(float* z, size_t n) {
  for (size_t k = 0; k < n; ++k) z[k] = std::max(z[k], 0.0f);
  return absl::OkStatus();
}

absl::Status HostMlpOps::ReluBackward(const float* a, float* da, size_t n) {
  for (size_t k = 0; k < n; ++k) {
    if (a[k] <= 0.0f) da[k] = 0.0f;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> HostMlpOps::SoftmaxCrossEntropy(const float* logits,
                                                       const uint32_t* labels,
                                                       int rows, int classes,
                                                       float* dz) {
  double loss = 0.0;
  for (int r = 0; r < rows; ++r) {
    const float* z = logits + static_cast<size_t>(r) * classes;
    float* d = dz + static_cast<size_t>(r) * classes;
    const float zmax = *std::max_element(z, z + classes);
    double sum = 0.0;
    for (int c = 0; c < classes; ++c) sum += std::exp(double{z[c]} - zmax);
    for (int c = 0; c < classes; ++c) {
      const double p = std::exp(double{z[c]} - zmax) / sum;
      const double y = static_cast<uint32_t>(c) == labels[r] ? 1.0 : 0.0;
      d[c] = static_cast<float>((p - y) / rows);
    }
    loss += -(double{z[labels[r]]} - zmax - std::log(sum));
  }
  return loss;
}

absl::Status HostMlpOps::ColumnSums(const float* in, int rows, int cols,
                                    float* out) {
  std::fill(out, out + cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c)
      out[c] += in[static_cast<size_t>(r) * cols + c];
  }
  return absl::OkStatus();
}

HostMlpBuffers::HostMlpBuffers(const std::vector<uint32_t>& widths,
                               uint32_t rows) {
  std::vector<float*> pointers;
  for (size_t size : MlpBufferSizes(widths, rows)) {
    storage_.emplace_back(size);
    pointers.push_back(storage_.back().data());
  }
  buffers_ = MlpBuffersOver(pointers);
}

}  // namespace morse::worker
