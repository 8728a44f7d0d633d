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

absl::Status LineError(const std::string& path, size_t line,
                       absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

// Reads every row, or only rows r with r % stride == offset.
absl::StatusOr<MlpDataset> ReadDataset(const proto::MlpSpec& spec,
                                       const std::string& path, uint32_t stride,
                                       uint32_t offset) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read data file '", path,
                     "' (deploy/quickstart.sh creates the digits set)"));
  }
  MlpDataset data;
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
        return LineError(
            path, line_no,
            absl::StrCat("label '", fields[0], "' is not a number"));
      }
      if (fields.size() != spec.features + 1) {
        return LineError(
            path, line_no,
            absl::StrCat(fields.size() - 1, " features, the config says ",
                         spec.features));
      }
      for (uint32_t f = 0; f < spec.features; ++f) {
        if (!absl::SimpleAtof(fields[f + 1], &values[f]) ||
            !std::isfinite(values[f])) {
          return LineError(
              path, line_no,
              absl::StrCat("feature ", f, " is not a finite number"));
        }
      }
    } else {  // libsvm: label index:value ... with 1-based indices
      std::vector<absl::string_view> fields =
          absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.empty() || !absl::SimpleAtod(fields[0], &label)) {
        return LineError(path, line_no,
                         "the line does not start with a numeric label");
      }
      for (size_t k = 1; k < fields.size(); ++k) {
        std::pair<absl::string_view, absl::string_view> kv =
            absl::StrSplit(fields[k], ':');
        uint32_t index = 0;
        float value = 0;
        if (!absl::SimpleAtoi(kv.first, &index) ||
            !absl::SimpleAtof(kv.second, &value) || index == 0 ||
            index > spec.features) {
          return LineError(
              path, line_no,
              absl::StrCat("bad entry '", fields[k], "' (features are 1..",
                           spec.features, ")"));
        }
        values[index - 1] = value;
      }
    }
    if (label < 0 || label >= spec.classes || label != std::floor(label)) {
      return LineError(
          path, line_no,
          absl::StrCat("label ", label, " is not an integer in [0, ",
                       spec.classes, ")"));
    }
    if (row++ % stride != offset) continue;
    data.labels.push_back(static_cast<uint32_t>(label));
    data.features.insert(data.features.end(), values.begin(), values.end());
  }
  if (data.rows() == 0)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no rows for this worker"));
  return data;
}

}  // namespace

namespace {

std::vector<uint32_t> LayerWidths(const proto::MlpSpec& spec) {
  std::vector<uint32_t> widths = {spec.features};
  widths.insert(widths.end(), spec.hidden.begin(), spec.hidden.end());
  widths.push_back(spec.classes);
  return widths;
}

}  // namespace

MlpWorkload::MlpWorkload(const proto::JobSpec& job, uint32_t rank,
                         MlpDataset train, std::optional<MlpDataset> test)
    : spec_(job.mlp),
      seed_(job.algorithm.seed),
      widths_(LayerWidths(spec_)),
      train_(std::move(train)),
      test_(std::move(test)),
      rank_(rank),
      order_(train_.rows()),
      batch_(widths_, spec_.batch_size),
      labels_(spec_.batch_size) {
  Rewind();
}

void MlpWorkload::Rewind() {
  rng_.seed(seed_ * 1000003 + rank_);
  std::iota(order_.begin(), order_.end(), 0);
  std::shuffle(order_.begin(), order_.end(), rng_);
  cursor_ = 0;
}

uint64_t MlpWorkload::dim() const { return proto::MlpParameterCount(spec_); }

void MlpWorkload::Initialize(absl::Span<float> x) const {
  uint64_t offset = 0;
  for (size_t l = 0; l + 1 < widths_.size(); ++l) {
    const uint64_t in = widths_[l], out = widths_[l + 1];
    float* w = x.data() + offset;
    compress::FillDraws({seed_, 0xC0FFEE03u, static_cast<uint32_t>(l), 0}, w,
                        in * out);
    const float bound = 1.0f / std::sqrt(static_cast<float>(in));
    for (uint64_t k = 0; k < in * out; ++k) w[k] = bound * (2.0f * w[k] - 1.0f);
    std::fill(w + in * out, w + in * out + out, 0.0f);
    offset += in * out + out;
  }
}

void MlpWorkload::Batch(int64_t step, float* input, uint32_t* labels) {
  if (step != next_step_) {
    // The order and cursor at `step`: step 0's, then one more shuffle per
    // pass over the rows completed before it.
    Rewind();
    const uint64_t consumed = static_cast<uint64_t>(step) * spec_.batch_size;
    for (uint64_t pass = 0; pass < consumed / order_.size(); ++pass) {
      std::shuffle(order_.begin(), order_.end(), rng_);
    }
    cursor_ = consumed % order_.size();
  }
  next_step_ = step + 1;
  for (uint32_t b = 0; b < spec_.batch_size; ++b) {
    if (cursor_ == order_.size()) {
      std::shuffle(order_.begin(), order_.end(), rng_);
      cursor_ = 0;
    }
    const size_t row = order_[cursor_++];
    std::copy_n(train_.features.begin() + row * spec_.features, spec_.features,
                input + static_cast<size_t>(b) * spec_.features);
    labels[b] = train_.labels[row];
  }
}

absl::StatusOr<double> MlpWorkload::Gradient(int64_t step,
                                             absl::Span<const float> x,
                                             absl::Span<float> grad) {
  Batch(step, batch_.input(), labels_.data());
  HostMlpOps ops;
  return MlpGradient(ops, widths_, x.data(), labels_.data(),
                     static_cast<int>(spec_.batch_size), batch_.buffers(),
                     grad.data());
}

namespace {

// The gradient on an engine's device: the pass buffers live there; each
// step's batch is drawn on the host and copied over (features and labels).
class DeviceMlpHook final : public GradientHook {
 public:
  DeviceMlpHook(MlpWorkload& workload, DeviceServices& device,
                MlpBuffers buffers, uint32_t* labels)
      : workload_(workload),
        device_(device),
        buffers_(buffers),
        labels_(labels),
        input_host_(static_cast<size_t>(workload.batch_size()) *
                    workload.widths()[0]),
        labels_host_(workload.batch_size()) {}

  absl::StatusOr<double> Gradient(int64_t step, const float* x,
                                  float* grad) override {
    workload_.Batch(step, input_host_.data(), labels_host_.data());
    if (absl::Status s = device_.CopyIn(buffers_.acts[0], input_host_.data(),
                                        4 * input_host_.size());
        !s.ok()) {
      return s;
    }
    if (absl::Status s = device_.CopyIn(labels_, labels_host_.data(),
                                        4 * labels_host_.size());
        !s.ok()) {
      return s;
    }
    return MlpGradient(device_.mlp_ops(), workload_.widths(), x, labels_,
                       static_cast<int>(workload_.batch_size()), buffers_,
                       grad);
  }

 private:
  MlpWorkload& workload_;
  DeviceServices& device_;
  MlpBuffers buffers_;
  uint32_t* labels_;
  std::vector<float> input_host_;
  std::vector<uint32_t> labels_host_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientHook>> MlpWorkload::GradientOn(
    Engine& engine) {
  DeviceServices* device = engine.device();
  if (device == nullptr) return Workload::GradientOn(engine);
  std::vector<float*> pointers;
  for (size_t size : MlpBufferSizes(widths_, spec_.batch_size)) {
    auto memory = device->Allocate(4 * size);
    if (!memory.ok()) return memory.status();
    pointers.push_back(static_cast<float*>(*memory));
  }
  auto labels = device->Allocate(4 * static_cast<size_t>(spec_.batch_size));
  if (!labels.ok()) return labels.status();
  return std::make_unique<DeviceMlpHook>(*this, *device,
                                         MlpBuffersOver(pointers),
                                         static_cast<uint32_t*>(*labels));
}

std::optional<double> MlpWorkload::TestAccuracy(
    absl::Span<const float> x) const {
  if (!test_.has_value()) return std::nullopt;
  constexpr uint32_t kChunk = 256;
  HostMlpOps ops;
  HostMlpBuffers buffers(widths_, kChunk);
  const uint32_t classes = spec_.classes;
  size_t correct = 0;
  for (size_t start = 0; start < test_->rows(); start += kChunk) {
    const uint32_t rows =
        static_cast<uint32_t>(std::min<size_t>(kChunk, test_->rows() - start));
    std::copy(test_->features.begin() + start * spec_.features,
              test_->features.begin() + (start + rows) * spec_.features,
              buffers.input());
    if (!MlpForward(ops, widths_, x.data(), static_cast<int>(rows),
                    buffers.buffers())
             .ok()) {
      return std::nullopt;  // the host ops do not fail
    }
    for (uint32_t b = 0; b < rows; ++b) {
      const float* z = buffers.logits() + static_cast<size_t>(b) * classes;
      const auto best = std::max_element(z, z + classes) - z;
      correct += static_cast<uint32_t>(best) == test_->labels[start + b];
    }
  }
  return static_cast<double>(correct) / static_cast<double>(test_->rows());
}

namespace {

// Data rank `rank` of `ranks`: the mlp's rows r with r mod ranks == rank
// (and the test set, `with_test`).
absl::StatusOr<std::unique_ptr<Workload>> MakeMlpWorkload(
    const proto::JobSpec& job, uint32_t rank, uint32_t ranks, bool with_test) {
  openblas_set_num_threads(1);  // N workers share the host's cores
  auto train = ReadDataset(job.mlp, job.mlp.train_path, ranks, rank);
  if (!train.ok()) return train.status();
  std::optional<MlpDataset> test;
  if (with_test && !job.mlp.test_path.empty()) {
    auto t = ReadDataset(job.mlp, job.mlp.test_path, 1, 0);
    if (!t.ok()) return t.status();
    test = *std::move(t);
  }
  return std::make_unique<MlpWorkload>(job, rank, *std::move(train),
                                       std::move(test));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(
    const proto::JobSpec& job, uint32_t rank) {
  const uint32_t local = job.local_ranks;
  std::vector<std::unique_ptr<Workload>> ranks;
  for (uint32_t k = 0; k < local; ++k) {
    const uint32_t data_rank = rank * local + k;
    if (job.workload == proto::WorkloadKind::kSynthetic) {
      // The node's local ranks share the first one's a and t.
      ranks.push_back(
          k == 0 ? std::make_unique<SyntheticWorkload>(job, data_rank)
                 : std::make_unique<SyntheticWorkload>(
                       static_cast<const SyntheticWorkload&>(*ranks[0]),
                       data_rank));
      continue;
    }
    auto own = MakeMlpWorkload(job, data_rank, job.workers() * local,
                               /*with_test=*/k == 0);
    if (!own.ok()) return own.status();
    ranks.push_back(*std::move(own));
  }
  if (local == 1) return std::move(ranks[0]);
  return MakeNodeWorkload(std::move(ranks));
}

}  // namespace morse::worker
