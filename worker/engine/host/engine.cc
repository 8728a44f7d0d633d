#include "worker/engine/host/engine.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/layers.h"
#include "compress/messages.h"
#include "compress/optimizer.h"
#include "compress/scratch.h"
#include "compress/sync.h"

namespace morse::worker::host {
namespace {

absl::Span<uint8_t> AsBytes(std::string* s) {
  return {reinterpret_cast<uint8_t*>(s->data()), s->size()};
}

class HostEngine final : public Engine {
 public:
  explicit HostEngine(const EngineState& state)
      : config_(*state.config),
        replica_(*state.replica),
        error_(*state.error),
        layers_(compress::OptimizerOf(config_).Layers()) {
    if (layers_ != nullptr) {
      piece_stats_.resize(state.layout->partitions().size());
      // Each partition's pieces (a layer each), and which partitions hold
      // each layer, in order.
      layer_partitions_.resize(compress::LayerCount(config_));
      partition_pieces_.resize(state.layout->partitions().size());
      for (const compress::Partition& p : state.layout->partitions()) {
        partition_pieces_[p.id] = compress::LayerPiecesOf(config_, p.range);
        for (const compress::LayerPiece& piece : partition_pieces_[p.id])
          layer_partitions_[piece.layer].push_back(p.id);
      }
      BeginReplies(-1);
    }
  }

  const std::string& kind() const override { return kName; }
  const std::string& description() const override { return kName; }
  DeviceServices* device() override { return nullptr; }
  // The encoded payloads in flight are host memory the window bounds.
  uint32_t DefaultWindow(size_t) const override { return 32; }

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
                      std::string* payload, float grad_scale,
                      const compress::StepHyper* hyper) override {
    const compress::SendRule rule = compress::PlanSend(
        config_, step, compress::Direction::kUp, rank, p.range.begin, hyper);
    const uint64_t n = p.range.size();
    // zero_one_adam's sync begun by BeginSyncLocalStep: this partition's
    // part of the local step first, its sync message in the same pass.
    absl::Span<float> message;
    if (replica_.local_step_by_range(step)) {
      if (rule.accumulated && !rule.idle) {
        message = compress::Scratch(compress::ScratchSlot::kLocalMomentum, n);
      }
      if (absl::Status s = replica_.LocalStepRange(
              step, p.range.begin, grad_.subspan(p.range.begin, n),
              message.empty() ? nullptr : &rule.sync, message);
          !s.ok()) {
        return s;
      }
    }
    payload->resize(compress::SendBytes(rule, n));
    return compress::EncodeWorkerMessage(rule, replica_, error_, p.range.begin,
                                         grad_.subspan(p.range.begin, n),
                                         grad_scale, AsBytes(payload), message);
  }

  absl::Status ApplyReply(
      int64_t step, const compress::Partition& p,
      absl::Span<const uint8_t> reply, const compress::StepHyper* hyper,
      float grad_scale, absl::Span<const double> piece_stats,
      absl::Span<const compress::ClipPiece> clip_pieces) override {
    return Apply(step, p, reply, hyper, grad_scale, piece_stats, clip_pieces,
                 /*amended=*/false);
  }

  absl::Status ApplyAmended(int64_t step, const compress::Partition& p,
                            absl::Span<const float> gradient,
                            const compress::StepHyper* hyper) override {
    if (gradient.size() != p.range.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("an amended gradient of ", gradient.size(),
                       " floats for partition ", p.id, " of ", p.range.size()));
    }
    return Apply(step, p,
                 {reinterpret_cast<const uint8_t*>(gradient.data()),
                  4 * gradient.size()},
                 hyper, 1.0f, {}, {}, /*amended=*/true);
  }

  // The reply (or an amended gradient, as an fp32 payload) applied to the
  // session's replica.
  absl::Status Apply(int64_t step, const compress::Partition& p,
                     absl::Span<const uint8_t> reply,
                     const compress::StepHyper* hyper, float grad_scale,
                     absl::Span<const double> piece_stats,
                     absl::Span<const compress::ClipPiece> clip_pieces,
                     bool amended) {
    if (piece_stats_.empty()) {
      return replica_.ApplyReply(step, p.range.begin, p.range.size(), reply,
                                 hyper, grad_scale, nullptr, clip_pieces,
                                 amended);
    }
    // A layer rule: the partition's share of CommitStep's statistics, from
    // its shard (which took them on its mirror), or else computed in the
    // same pass as the reply's moments, while other replies are on the way.
    const std::vector<compress::LayerPiece>& pieces = partition_pieces_[p.id];
    const bool given = !piece_stats.empty();
    if (given && piece_stats.size() != layers_->stats() * pieces.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the reply of partition ", p.id, " carries ",
                       piece_stats.size(), " layer statistics for ",
                       pieces.size(), " pieces (", layers_->stats(), " each)"));
    }
    if (given && (grad_scale != 1.0f || !clip_pieces.empty())) {
      // a shard sends none when it clips
      return absl::InvalidArgumentError(absl::StrCat(
          "the reply of partition ", p.id,
          " carries layer statistics for a step that clips the average"));
    }
    std::vector<double> segments;
    absl::Status applied = replica_.ApplyReply(
        step, p.range.begin, p.range.size(), reply, hyper, grad_scale,
        given ? nullptr : &segments, clip_pieces, amended);
    if (!applied.ok()) return applied;
    piece_stats_[p.id] = {
        step, given
                  ? std::vector<double>(piece_stats.begin(), piece_stats.end())
                  : compress::PieceStats(*layers_, pieces, segments)};
    MoveCompleteLayers(step, p, hyper);
    return applied;
  }

  void BeginReplies(int64_t step) override {
    if (piece_stats_.empty()) return;
    MutexLock lock(&layers_mu_);
    layers_step_ = step;
    pieces_missing_.clear();
    for (const std::vector<uint32_t>& holders : layer_partitions_)
      pieces_missing_.push_back(holders.size());
    moved_.assign(layer_partitions_.size(), false);
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
    std::vector<std::vector<double>> stats(piece_stats_.size());
    for (size_t i = 0; i < stats.size(); ++i) {
      // Statistics of another step (a reply not applied here) are computed
      // again.
      if (piece_stats_[i].step == step)
        stats[i] = std::move(piece_stats_[i].values);
      piece_stats_[i] = {};
    }
    std::vector<bool> moved;
    {
      MutexLock lock(&layers_mu_);
      if (layers_step_ == step) moved = moved_;
    }
    absl::StatusOr<std::vector<double>> commit =
        replica_.CommitStep(step, hypers, stats, pool, moved);
    BeginReplies(-1);
    return commit;
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
  // The optimizer's layer rule (compress/layers.h), or nullptr.
  const compress::LayerRule* const layers_;
  // A layer rule's: per partition, the statistics of its pieces that
  // ApplyReply took (each slot written by its partition's reply only).
  struct HeldStats {
    int64_t step = -1;
    std::vector<double> values;  // PieceStats of partition_pieces_
  };
  std::vector<HeldStats> piece_stats_;

  // A layer rule's: moves x over each layer of partition `p` whose pieces
  // all have their statistics at `step` (compress::Replica::MoveLayer), on
  // this thread, while other replies are on the way: CommitStep then moves
  // the others alone. A layer that cannot move here is left to CommitStep,
  // which says why.
  void MoveCompleteLayers(int64_t step, const compress::Partition& p,
                          const compress::StepHyper* hyper) {
    std::vector<uint32_t> complete;
    {
      MutexLock lock(&layers_mu_);
      if (layers_step_ != step) return;
      for (const compress::LayerPiece& piece : partition_pieces_[p.id]) {
        if (--pieces_missing_[piece.layer] == 0)
          complete.push_back(piece.layer);
      }
    }
    for (uint32_t layer : complete) {
      // Written before their partitions counted (under the lock above).
      std::vector<double> sums;
      bool all = true;
      for (uint32_t id : layer_partitions_[layer]) {
        const HeldStats& held = piece_stats_[id];
        all = all && held.step == step;
        if (!all) break;
        // The partition's pieces: this layer's alone.
        const std::vector<compress::LayerPiece>& pieces = partition_pieces_[id];
        for (size_t k = 0; k < pieces.size(); ++k) {
          if (pieces[k].layer != layer) continue;
          const auto first = held.values.begin() + layers_->stats() * k;
          sums.insert(sums.end(), first, first + layers_->stats());
        }
      }
      if (!all || !replica_.MoveLayer(step, layer, hyper, sums).ok()) continue;
      MutexLock lock(&layers_mu_);
      if (layers_step_ == step) moved_[layer] = true;
    }
  }

  std::vector<std::vector<compress::LayerPiece>> partition_pieces_;
  std::vector<std::vector<uint32_t>> layer_partitions_;
  Mutex layers_mu_;
  int64_t layers_step_ ABSL_GUARDED_BY(layers_mu_) = -1;
  std::vector<size_t> pieces_missing_ ABSL_GUARDED_BY(layers_mu_);
  std::vector<bool> moved_ ABSL_GUARDED_BY(layers_mu_);
  absl::Span<const float>
      grad_;  // what Encode reads: own_grad_ or the caller's
};

}  // namespace

std::unique_ptr<Engine> CreateEngine(const EngineState& state) {
  return std::make_unique<HostEngine>(state);
}

}  // namespace morse::worker::host
