// The mlp workload: a ReLU MLP with softmax cross-entropy, trained on a CSV
// or libsvm data set. Parameters are laid out layer after layer as the
// weights (in x out, row-major) and then the biases (out).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "compress/stochastic_rounding.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

struct Dataset {
  std::vector<float> features;  // rows x dim, row-major
  std::vector<uint32_t> labels;
  uint32_t dim = 0;
  size_t rows() const { return labels.size(); }
};

absl::Status LineError(const std::string& path, size_t line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

// Reads every row, or only rows r with r % stride == offset.
absl::StatusOr<Dataset> ReadDataset(const proto::MlpSpec& spec, const std::string& path,
                                    uint32_t stride, uint32_t offset) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "cannot read data file '", path, "' (deploy/quickstart.sh creates the digits set)"));
  }
  Dataset data;
  data.dim = spec.features;
  std::string line;
  size_t line_no = 0, row = 0;
  std::vector<float> values(spec.features);
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    std::fill(values.begin(), values.end(), 0.0f);
    double label = 0;
    if (spec.format == "csv") {
      std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
      if (!absl::SimpleAtod(fields[0], &label)) {
        if (row == 0 && data.rows() == 0) continue;  // a header line
        return LineError(path, line_no, absl::StrCat("label '", fields[0], "' is not a number"));
      }
      if (fields.size() != spec.features + 1) {
        return LineError(path, line_no, absl::StrCat(fields.size() - 1, " features, the config says ",
                                                     spec.features));
      }
      for (uint32_t f = 0; f < spec.features; ++f) {
        if (!absl::SimpleAtof(fields[f + 1], &values[f]) || !std::isfinite(values[f])) {
          return LineError(path, line_no, absl::StrCat("feature ", f, " is not a finite number"));
        }
      }
    } else {  // libsvm: label index:value ... with 1-based indices
      std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.empty() || !absl::SimpleAtod(fields[0], &label)) {
        return LineError(path, line_no, "the line does not start with a numeric label");
      }
      for (size_t k = 1; k < fields.size(); ++k) {
        std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(fields[k], ':');
        uint32_t index = 0;
        float value = 0;
        if (!absl::SimpleAtoi(kv.first, &index) || !absl::SimpleAtof(kv.second, &value) ||
            index == 0 || index > spec.features) {
          return LineError(path, line_no, absl::StrCat("bad entry '", fields[k], "' (features are 1..",
                                                       spec.features, ")"));
        }
        values[index - 1] = value;
      }
    }
    if (label < 0 || label >= spec.classes || label != std::floor(label)) {
      return LineError(path, line_no, absl::StrCat("label ", label, " is not an integer in [0, ",
                                                   spec.classes, ")"));
    }
    if (row++ % stride != offset) continue;
    data.labels.push_back(static_cast<uint32_t>(label));
    data.features.insert(data.features.end(), values.begin(), values.end());
  }
  if (data.rows() == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": no rows for this worker"));
  return data;
}

class MlpWorkload final : public Workload {
 public:
  MlpWorkload(const proto::JobSpec& job, uint32_t rank, Dataset train, std::optional<Dataset> test)
      : spec_(job.mlp),
        seed_(job.algorithm.seed),
        train_(std::move(train)),
        test_(std::move(test)),
        rng_(job.algorithm.seed * 1000003 + rank),
        order_(train_.rows()) {
    widths_.push_back(spec_.features);
    widths_.insert(widths_.end(), spec_.hidden.begin(), spec_.hidden.end());
    widths_.push_back(spec_.classes);
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng_);
  }

  uint64_t dim() const override { return proto::MlpParameterCount(spec_); }
  uint64_t samples_per_step() const override { return spec_.batch_size; }

  void Initialize(absl::Span<float> x) const override {
    uint64_t offset = 0;
    for (size_t l = 0; l + 1 < widths_.size(); ++l) {
      const uint64_t in = widths_[l], out = widths_[l + 1];
      float* w = x.data() + offset;
      compress::FillDraws({seed_, 0xC0FFEE03u, static_cast<uint32_t>(l), 0}, w, in * out);
      const float bound = 1.0f / std::sqrt(static_cast<float>(in));
      for (uint64_t k = 0; k < in * out; ++k) w[k] = bound * (2.0f * w[k] - 1.0f);
      std::fill(w + in * out, w + in * out + out, 0.0f);
      offset += in * out + out;
    }
  }

  absl::StatusOr<double> Gradient(int64_t, absl::Span<const float> x,
                                  absl::Span<float> grad) override {
    const uint32_t batch = spec_.batch_size;
    std::vector<float> input(static_cast<size_t>(batch) * spec_.features);
    std::vector<uint32_t> labels(batch);
    for (uint32_t b = 0; b < batch; ++b) {
      if (cursor_ == order_.size()) {
        std::shuffle(order_.begin(), order_.end(), rng_);
        cursor_ = 0;
      }
      const size_t row = order_[cursor_++];
      std::copy_n(train_.features.begin() + row * spec_.features, spec_.features,
                  input.begin() + static_cast<size_t>(b) * spec_.features);
      labels[b] = train_.labels[row];
    }
    std::vector<std::vector<float>> acts = Forward(x, input, batch);
    // Softmax cross-entropy; dZ = (p - y) / batch.
    std::vector<float>& logits = acts.back();
    const uint32_t classes = spec_.classes;
    double loss = 0.0;
    std::vector<float> dz(logits.size());
    for (uint32_t b = 0; b < batch; ++b) {
      const float* z = logits.data() + b * classes;
      const float zmax = *std::max_element(z, z + classes);
      double sum = 0.0;
      for (uint32_t c = 0; c < classes; ++c) sum += std::exp(double{z[c]} - zmax);
      for (uint32_t c = 0; c < classes; ++c) {
        const double p = std::exp(double{z[c]} - zmax) / sum;
        dz[b * classes + c] = static_cast<float>((p - (c == labels[b] ? 1.0 : 0.0)) / batch);
      }
      loss -= double{z[labels[b]]} - zmax - std::log(sum);
    }
    // Backward through the layers.
    uint64_t offset = dim();
    for (size_t l = widths_.size() - 1; l >= 1; --l) {
      const int in = static_cast<int>(widths_[l - 1]), out = static_cast<int>(widths_[l]);
      offset -= static_cast<uint64_t>(in) * out + out;
      const float* w = x.data() + offset;
      float* dw = grad.data() + offset;
      float* db = dw + static_cast<size_t>(in) * out;
      const std::vector<float>& a = acts[l - 1];
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, out, static_cast<int>(batch), 1.0f,
                  a.data(), in, dz.data(), out, 0.0f, dw, out);
      std::fill(db, db + out, 0.0f);
      for (uint32_t b = 0; b < batch; ++b) {
        for (int o = 0; o < out; ++o) db[o] += dz[static_cast<size_t>(b) * out + o];
      }
      if (l == 1) break;
      std::vector<float> da(static_cast<size_t>(batch) * in);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(batch), in, out, 1.0f,
                  dz.data(), out, w, out, 0.0f, da.data(), in);
      for (size_t k = 0; k < da.size(); ++k) {
        if (a[k] <= 0.0f) da[k] = 0.0f;  // ReLU
      }
      dz.swap(da);
    }
    return loss / batch;
  }

  std::optional<double> TestAccuracy(absl::Span<const float> x) const override {
    if (!test_.has_value()) return std::nullopt;
    size_t correct = 0;
    constexpr uint32_t kChunk = 256;
    for (size_t start = 0; start < test_->rows(); start += kChunk) {
      const uint32_t rows = static_cast<uint32_t>(std::min<size_t>(kChunk, test_->rows() - start));
      std::vector<float> input(test_->features.begin() + start * spec_.features,
                               test_->features.begin() + (start + rows) * spec_.features);
      const std::vector<float> logits = Forward(x, input, rows).back();
      for (uint32_t b = 0; b < rows; ++b) {
        const float* z = logits.data() + b * spec_.classes;
        const auto best = std::max_element(z, z + spec_.classes) - z;
        correct += static_cast<uint32_t>(best) == test_->labels[start + b];
      }
    }
    return static_cast<double>(correct) / static_cast<double>(test_->rows());
  }

 private:
  // Activations of every layer: acts[0] is the input, acts.back() the logits.
  std::vector<std::vector<float>> Forward(absl::Span<const float> x, const std::vector<float>& input,
                                          uint32_t batch) const {
    std::vector<std::vector<float>> acts = {input};
    uint64_t offset = 0;
    for (size_t l = 0; l + 1 < widths_.size(); ++l) {
      const int in = static_cast<int>(widths_[l]), out = static_cast<int>(widths_[l + 1]);
      const float* w = x.data() + offset;
      const float* bias = w + static_cast<size_t>(in) * out;
      std::vector<float> z(static_cast<size_t>(batch) * out);
      for (uint32_t b = 0; b < batch; ++b) std::copy_n(bias, out, z.begin() + static_cast<size_t>(b) * out);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(batch), out, in, 1.0f,
                  acts.back().data(), in, w, out, 1.0f, z.data(), out);
      if (l + 2 < widths_.size()) {
        for (float& v : z) v = std::max(v, 0.0f);
      }
      acts.push_back(std::move(z));
      offset += static_cast<uint64_t>(in) * out + out;
    }
    return acts;
  }

  proto::MlpSpec spec_;
  uint64_t seed_;
  std::vector<uint32_t> widths_;
  Dataset train_;
  std::optional<Dataset> test_;
  std::mt19937_64 rng_;
  std::vector<size_t> order_;
  size_t cursor_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const proto::JobSpec& job, uint32_t rank) {
  if (job.workload == proto::WorkloadKind::kSynthetic) {
    return std::make_unique<SyntheticWorkload>(job, rank);
  }
  openblas_set_num_threads(1);  // N workers share the host's cores
  auto train = ReadDataset(job.mlp, job.mlp.train_path, job.workers(), rank);
  if (!train.ok()) return train.status();
  std::optional<Dataset> test;
  if (!job.mlp.test_path.empty()) {
    auto t = ReadDataset(job.mlp, job.mlp.test_path, 1, 0);
    if (!t.ok()) return t.status();
    test = *std::move(t);
  }
  return std::make_unique<MlpWorkload>(job, rank, *std::move(train), std::move(test));
}

}  // namespace morse::worker
