#include "worker/engine/host/engine.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/messages.h"
#include "compress/optimizer.h"

namespace morse::worker::host {
namespace {

absl::Span<uint8_t> AsBytes(std::string* s) {
  return {reinterpret_cast<uint8_t*>(s->data()), s->size()};
}

class HostEngine final : public Engine {
 public:
  explicit HostEngine(const EngineState& state)
      : config_(*state.config), replica_(*state.replica), error_(*state.error) {
    if (compress::CommitsLayers(config_)) {
      lamb_segments_.resize(state.layout->partitions().size());
    }
  }

  const std::string& kind() const override { return kName; }
  const std::string& description() const override { return kName; }
  DeviceServices* device() override { return nullptr; }

  // The state is the session's: nothing to move.
  absl::Status Load(const compress::Replica&,
                    const compress::ErrorFeedback&) override {
    return absl::OkStatus();
  }
  absl::Status Store(compress::Replica&, compress::ErrorFeedback&) override {
    return absl::OkStatus();
  }

  absl::Status SetHostGradient(absl::Span<const float> grad) override {
    if (grad.size() != config_.layout.dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of ", grad.size(), " elements for ",
                       config_.layout.dim, " parameters"));
    }
    grad_ = grad;
    return absl::OkStatus();
  }
  absl::Status ReadGradient(absl::Span<float> grad) override {
    if (grad.size() != grad_.size())
      return absl::InvalidArgumentError("the gradient has dim floats");
    std::copy(grad_.begin(), grad_.end(), grad.begin());
    return absl::OkStatus();
  }
  absl::Status WaitFor(void*) override { return absl::OkStatus(); }

  absl::Status Encode(int64_t step, uint32_t rank, const compress::Partition& p,
                      std::string* payload, float grad_scale) override {
    const compress::SendRule rule = compress::PlanSend(
        config_, step, compress::Direction::kUp, rank, p.range.begin);
    const uint64_t n = p.range.size();
    // zero_one_adam's sync begun by BeginSyncLocalStep: this partition's
    // part of the local step first.
    if (replica_.local_step_by_range(step)) {
      if (absl::Status s = replica_.LocalStepRange(
              step, p.range.begin, grad_.subspan(p.range.begin, n));
          !s.ok()) {
        return s;
      }
    }
    payload->resize(compress::SendBytes(rule, n));
    return compress::EncodeWorkerMessage(rule, replica_, error_, p.range.begin,
                                         grad_.subspan(p.range.begin, n),
                                         grad_scale, AsBytes(payload));
  }

  absl::Status ApplyReply(int64_t step, const compress::Partition& p,
                          absl::Span<const uint8_t> reply,
                          const compress::StepHyper* hyper,
                          float grad_scale) override {
    absl::Status applied = replica_.ApplyReply(
        step, p.range.begin, p.range.size(), reply, hyper, grad_scale);
    if (applied.ok() && !lamb_segments_.empty()) {
      // The partition's share of CommitStep's statistics, while this pool
      // thread has it and other replies are still on the way.
      lamb_segments_[p.id] = {step,
                              replica_.LambSegments(step, p.range, hyper)};
    }
    return applied;
  }

  absl::StatusOr<std::vector<float>> LocalStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      float grad_scale, compress::ComputePool* pool) override {
    if (grad_.size() != config_.layout.dim)
      return absl::FailedPreconditionError("no gradient set");
    if (absl::Status s =
            replica_.LocalStep(step, grad_, hypers, grad_scale, pool);
        !s.ok())
      return s;
    const absl::Span<const float> sums = replica_.lr_sums();
    return std::vector<float>(sums.begin(), sums.end());
  }

  absl::StatusOr<std::vector<float>> BeginSyncLocalStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers) override {
    if (absl::Status s = replica_.BeginSyncLocalStep(step, hypers); !s.ok())
      return s;
    const absl::Span<const float> sums = replica_.lr_sums();
    return std::vector<float>(sums.begin(), sums.end());
  }

  absl::StatusOr<std::vector<double>> CommitStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      compress::ComputePool* pool) override {
    std::vector<std::vector<double>> segments(lamb_segments_.size());
    for (size_t i = 0; i < segments.size(); ++i) {
      // Statistics of another step (a reply not applied here) are computed
      // again.
      if (lamb_segments_[i].step == step)
        segments[i] = std::move(lamb_segments_[i].values);
      lamb_segments_[i] = {};
    }
    return replica_.LambStep(step, hypers, segments, pool);
  }

  absl::StatusOr<double> GradientSumOfSquares() override {
    if (grad_.size() != config_.layout.dim)
      return absl::FailedPreconditionError("no gradient set");
    return compress::GradientSumOfSquares(grad_);
  }

 protected:
  float* x() override { return replica_.x().data(); }
  // The hook writes into the engine's own gradient, which the next steps
  // then encode.
  float* grad() override {
    // Called for every gradient range while the pool encodes the ranges
    // before: only the first call writes (the others only read).
    if (own_grad_.size() != config_.layout.dim) {
      own_grad_.resize(
          config_.layout.dim);  // only engines that run hooks pay for it
    }
    if (grad_.data() != own_grad_.data()) grad_ = own_grad_;
    return own_grad_.data();
  }
  uint64_t x_dim() const override { return config_.layout.dim; }

 private:
  static inline const std::string kName = "cpu";
  const compress::AlgorithmConfig& config_;
  compress::Replica& replica_;
  compress::ErrorFeedback& error_;
  std::vector<float> own_grad_;  // the hook's output
  // onebit_lamb: per partition, the statistics of its segments computed by
  // ApplyReply (each slot written by its partition's reply only).
  struct LambSegments {
    int64_t step = -1;
    std::vector<double> values;
  };
  std::vector<LambSegments> lamb_segments_;
  absl::Span<const float>
      grad_;  // what Encode reads: own_grad_ or the caller's
};

}  // namespace

std::unique_ptr<Engine> CreateEngine(const EngineState& state) {
  return std::make_unique<HostEngine>(state);
}

}  // namespace morse::worker::host
