// NodeWorkload: a node of L local ranks as one worker (JobConfig.
// local_ranks; docs/design.md 2.10), for the built-in workloads.
//
// The node's gradient is ((g_0 + g_1) + ... + g_{L-1}) / L in float, in
// local-rank order, g_k the gradient of local rank k's workload at the same
// x: the rule morse.torch's node group follows (worker/python/morse/torch/
// node.py, NodeGroup.average), so the shards see one worker per node. The
// local ranks run one after another on the caller's thread, each writing
// into its own buffer before the sum.
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

class NodeWorkload final : public Workload {
 public:
  explicit NodeWorkload(std::vector<std::unique_ptr<Workload>> ranks)
      : ranks_(std::move(ranks)), own_(ranks_[0]->dim()) {}

  uint64_t dim() const override { return ranks_[0]->dim(); }
  void Initialize(absl::Span<float> x) const override {
    ranks_[0]->Initialize(x);
  }

  absl::StatusOr<double> Gradient(int64_t step, absl::Span<const float> x,
                                  absl::Span<float> grad) override {
    if (ComputesRanges()) {  // one range: the floats and loss of any split
      double lanes[4] = {0, 0, 0, 0};
      if (absl::Status s = GradientRange(step, x, grad, 0, dim(), lanes);
          !s.ok())
        return s;
      return GradientHook::MeanLoss(lanes, dim());
    }
    double loss = 0;  // the mean of the ranks' losses
    for (size_t k = 0; k < ranks_.size(); ++k) {
      auto own = ranks_[k]->Gradient(step, x, k == 0 ? grad : Own());
      if (!own.ok()) return Local(k, own.status());
      loss += *own;
      if (k > 0) Add(grad, 0, dim());
    }
    Average(grad, 0, dim());
    return loss / static_cast<double>(ranks_.size());
  }

  bool ComputesRanges() const override {
    for (const auto& rank : ranks_)
      if (!rank->ComputesRanges()) return false;
    return true;
  }

  // Each local rank's range, summed; the loss lanes take the mean of the
  // ranks' lanes over the range (so ranges in increasing order give the
  // floats of one call over everything, and its loss within rounding).
  absl::Status GradientRange(int64_t step, absl::Span<const float> x,
                             absl::Span<float> grad, uint64_t begin,
                             uint64_t end, double loss_lanes[4]) override {
    double sum[4] = {0, 0, 0, 0};
    for (size_t k = 0; k < ranks_.size(); ++k) {
      double lanes[4] = {0, 0, 0, 0};
      if (absl::Status s = ranks_[k]->GradientRange(
              step, x, k == 0 ? grad : Own(), begin, end, lanes);
          !s.ok())
        return Local(k, s);
      for (int l = 0; l < 4; ++l) sum[l] += lanes[l];
      if (k > 0) Add(grad, begin, end);
    }
    Average(grad, begin, end);
    for (int l = 0; l < 4; ++l)
      loss_lanes[l] += sum[l] / static_cast<double>(ranks_.size());
    return absl::OkStatus();
  }

  uint64_t samples_per_step() const override {
    uint64_t samples = 0;
    for (const auto& rank : ranks_) samples += rank->samples_per_step();
    return samples;
  }

  std::optional<double> TestAccuracy(absl::Span<const float> x) const override {
    return ranks_[0]->TestAccuracy(x);  // the same model on every rank
  }

  absl::StatusOr<std::unique_ptr<GradientHook>> GradientOn(
      Engine& engine) override {
    if (engine.device() == nullptr) return Workload::GradientOn(engine);
    return absl::UnimplementedError(absl::StrCat(
        "local_ranks ", ranks_.size(), " on ", engine.kind(),
        ": a node's local ranks run on the host; run this worker with "
        "--device cpu, or local_ranks 1 with a worker per GPU"));
  }

 private:
  absl::Span<float> Own() { return absl::MakeSpan(own_); }

  void Add(absl::Span<float> grad, uint64_t begin, uint64_t end) const {
    for (uint64_t j = begin; j < end; ++j) grad[j] += own_[j];
  }

  void Average(absl::Span<float> grad, uint64_t begin, uint64_t end) const {
    const float count = static_cast<float>(ranks_.size());
    for (uint64_t j = begin; j < end; ++j) grad[j] /= count;
  }

  absl::Status Local(size_t k, const absl::Status& status) const {
    return absl::Status(status.code(),
                        absl::StrCat("local rank ", k, " of ", ranks_.size(),
                                     ": ", status.message()));
  }

  std::vector<std::unique_ptr<Workload>> ranks_;
  std::vector<float> own_;  // local rank k > 0's gradient, before the sum
};

}  // namespace

std::unique_ptr<Workload> MakeNodeWorkload(
    std::vector<std::unique_ptr<Workload>> ranks) {
  return std::make_unique<NodeWorkload>(std::move(ranks));
}

}  // namespace morse::worker
