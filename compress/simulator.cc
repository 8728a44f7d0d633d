#include "compress/simulator.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "compress/layers.h"
#include "compress/messages.h"
#include "compress/optimizer.h"
#include "compress/replica.h"

namespace morse::compress {

absl::StatusOr<Simulator> Simulator::Create(const AlgorithmConfig& config,
                                            absl::Span<const float> x0) {
  if (absl::Status s = ValidateAlgorithmConfig(config); !s.ok()) return s;
  if (x0.size() != config.layout.dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x0 has ", x0.size(), " elements, the layout ", config.layout.dim));
  }
  absl::StatusOr<Layout> layout = Layout::Create(config.layout);
  if (!layout.ok()) return layout.status();
  return Simulator(config, *std::move(layout), x0);
}

Simulator::Simulator(const AlgorithmConfig& config, Layout layout,
                     absl::Span<const float> x0)
    : config_(config),
      layout_(std::move(layout)),
      x_(x0.begin(), x0.end()),
      m_(x0.size(), 0.0f),
      v_(x0.size(), 0.0f) {
  const Optimizer& optimizer = OptimizerOf(config);
  if (optimizer.Layers() != nullptr) {  // its per-element array, its layers'
    v_fresh_.assign(x0.size(), 0.0f);
    layer_state_ = optimizer.InitialState(config, optimizer.State(config)[1]);
  }
  for (uint32_t i = 0; i < config.workers; ++i) {
    worker_errors_.emplace_back(config.worker_feedback, x0.size(),
                                config.layout.block_elems);
  }
  for (uint32_t s = 0; s < config.layout.shards; ++s) {
    server_errors_.emplace_back(config.server_feedback,
                                layout_.shard_range(s).size(),
                                config.layout.block_elems);
  }
}

bool Simulator::compressing() const {
  return PlanStep(config_, step_).compressing;
}

absl::Status Simulator::RoundTrip(
    const Partition& p, absl::Span<const absl::Span<const float>> gradients,
    absl::Span<const uint32_t> absent, const StepHyper* hyper,
    std::vector<float>& reply) {
  const size_t n = p.range.size();
  if (Idle(config_, step_, p.range.begin)) {  // sits this step out
    reply.clear();
    return absl::OkStatus();
  }
  // Workers: what each sends for this partition (the sender's rule), encoded.
  SendRule up;
  std::vector<std::vector<uint8_t>> pushes(config_.workers);
  std::vector<float> message(n);
  for (uint32_t i = 0; i < config_.workers; ++i) {
    up = PlanSend(config_, step_, Direction::kUp, i, p.range.begin, hyper);
    absl::Span<const float> part = gradients[i].subspan(p.range.begin, n);
    if (up.accumulated) {  // zero_one_adam's sync: the worker's interval, not
                           // its gradient
      const Local& local = locals_[i];
      ZeroOneSyncMessage(up.sync, lr_sums_[p.segment],
                         absl::MakeConstSpan(local.u).subspan(p.range.begin, n),
                         absl::MakeConstSpan(local.m).subspan(p.range.begin, n),
                         absl::MakeConstSpan(v_).subspan(p.range.begin, n),
                         absl::MakeSpan(message));
      part = message;
    } else if (up.local_momentum) {
      LocalMomentum(up.beta1, absl::MakeConstSpan(m_).subspan(p.range.begin, n),
                    part, absl::MakeSpan(message));
      part = message;
    }
    pushes[i].resize(PayloadBytes(up.codec, n));
    const absl::Span<const float> mask_v =
        up.mask ? absl::MakeConstSpan(v_).subspan(p.range.begin, n)
                : absl::Span<const float>();
    absl::Status s =
        up.feedback
            ? worker_errors_[i].Compress(up.codec, p.range.begin, part, up.key,
                                         absl::MakeSpan(pushes[i]), mask_v)
            : Encode(up.codec, part, up.key, absl::MakeSpan(pushes[i]));
    if (!s.ok()) return s;
  }
  // Shard: average the members' in rank order, recompress with its own
  // error.
  std::vector<absl::Span<const uint8_t>> views;
  for (uint32_t i = 0; i < config_.workers; ++i) {
    if (!std::binary_search(absent.begin(), absent.end(), i))
      views.emplace_back(pushes[i]);
  }
  const SendRule down = PlanSend(config_, step_, Direction::kDown,
                                 config_.workers + p.shard, p.range.begin);
  std::vector<uint8_t> payload(PayloadBytes(down.codec, n));
  const uint64_t shard_offset =
      p.range.begin - layout_.shard_range(p.shard).begin;
  const absl::Span<const float> mask_v =
      down.mask ? absl::MakeConstSpan(v_).subspan(p.range.begin, n)
                : absl::Span<const float>();
  if (absl::Status s =
          EncodeShardReply(down, up.codec, views, server_errors_[p.shard],
                           shard_offset, n, mask_v, absl::MakeSpan(payload));
      !s.ok()) {
    return s;
  }
  // Workers: decode the reply, the same bytes for everyone.
  reply.resize(n);
  return Decode(down.codec, payload, absl::MakeSpan(reply));
}

absl::Status Simulator::Step(
    absl::Span<const absl::Span<const float>> gradients,
    absl::Span<const StepHyper> hypers, const Absent& absent) {
  if (absent.size() > layout_.partitions().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("absent ranks for ", absent.size(),
                     " partitions; there are ", layout_.partitions().size()));
  }
  for (size_t p = 0; p < absent.size(); ++p) {
    if (!ValidAbsent(absent[p], config_.workers)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the absent ranks of partition ", p,
          " are not distinct ranks in ascending order with one left in"));
    }
  }
  if (gradients.size() != config_.workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        gradients.size(), " gradients for ", config_.workers, " workers"));
  }
  for (const auto& g : gradients) {
    if (g.size() != x_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of ", g.size(), " elements for a model of ", x_.size()));
    }
  }
  // The compression phase's clip: each worker's gradient scaled by its own
  // factor before anything reads it (as Replica::LocalMomentum does).
  std::vector<std::vector<float>> clipped;
  clipped.reserve(config_.workers);
  std::vector<absl::Span<const float>> views(gradients.begin(),
                                             gradients.end());
  if (ClipsLocally(config_, step_)) {
    for (uint32_t i = 0; i < config_.workers; ++i) {
      const float scale =
          ClipScale(GradientSumOfSquares(gradients[i]), config_.clip_grad_norm);
      if (scale == 1.0f) continue;
      std::vector<float>& g =
          clipped.emplace_back(gradients[i].begin(), gradients[i].end());
      for (float& gj : g) gj *= scale;
      views[i] = g;
    }
  }
  gradients = views;
  if (absl::Status s = CheckHyperCount(hypers, layout_.segment_count());
      !s.ok()) {
    return s;
  }
  if (hypers.size() > 1 && !OptimizerOf(config_).HyperByPartition()) {
    return absl::InvalidArgumentError(
        absl::StrCat(OptimizerOf(config_).name(),
                     " applies one lr and weight_decay to the whole model"));
  }
  for (const StepHyper& hyper : hypers) {
    if (absl::Status s = CheckStepHyper(config_, hyper); !s.ok()) return s;
    if (absl::Status s = CheckHyperAtStep(hyper, step_); !s.ok()) return s;
  }
  // zero_one_adam's local phase (design.md 2.7): every worker steps on its
  // own, each segment with its own lr and weight_decay; only a sync
  // exchanges anything.
  const StepPlan plan = PlanStep(config_, step_);
  std::vector<StepHyper> sync_hypers;
  if (plan.local) {
    const uint32_t segments = layout_.segment_count();
    if (StartsInterval(config_, step_)) {
      locals_.assign(config_.workers,
                     Local{x_, m_, std::vector<float>(x_.size(), 0.0f)});
      lr_sums_.assign(segments, 0.0f);
    }
    for (uint32_t k = 0; k < segments; ++k) {
      const AdamScalars s =
          LocalStepScalars(config_, step_, HyperOf(hypers, k));
      const Range r = SegmentRange(layout_.spec(), k);
      for (uint32_t i = 0; i < config_.workers; ++i) {
        Local& local = locals_[i];
        const auto part = [&](std::vector<float>& a) {
          return absl::MakeSpan(a).subspan(r.begin, r.size());
        };
        ZeroOneLocalStep(s, gradients[i].subspan(r.begin, r.size()),
                         part(local.x), part(local.m), part(local.u),
                         absl::MakeConstSpan(v_).subspan(r.begin, r.size()),
                         /*write_x=*/!plan.exchanges);
      }
      lr_sums_[k] += s.lr;
    }
    if (!plan.exchanges) {
      diverged_ = true;
      ++step_;
      return absl::OkStatus();
    }
    // What the workers' sync pushes carry as their lr: each segment's sum
    // (with its step's betas and eps).
    for (size_t k = 0; k < hypers.size(); ++k) {
      sync_hypers.push_back(hypers[k]);
      sync_hypers.back().lr = lr_sums_[k];
    }
    hypers = sync_hypers;
  }
  // Every partition's round trip reads m before any update of this step.
  std::vector<std::vector<float>> replies(layout_.partitions().size());
  for (const Partition& p : layout_.partitions()) {
    const absl::Span<const uint32_t> out =
        p.id < absent.size() ? absl::MakeConstSpan(absent[p.id])
                             : absl::Span<const uint32_t>();
    if (absl::Status s = RoundTrip(p, gradients, out,
                                   HyperOf(hypers, p.segment), replies[p.id]);
        !s.ok()) {
      return s;
    }
  }
  // The averaged gradient's clip factor: each shard's sum of squares of
  // its partitions' decoded replies, added in partition order.
  float grad_scale = 1.0f;
  if (ClipsAverage(config_, step_)) {
    double sum_of_squares = 0;
    for (const Partition& p : layout_.partitions())
      sum_of_squares += GradientSumOfSquares(replies[p.id]);
    grad_scale = ClipScale(sum_of_squares, config_.clip_grad_norm);
  }
  const std::vector<ReplyRule> rules =
      PlanReplies(config_, step_, hypers, grad_scale);
  for (const Partition& p : layout_.partitions()) {
    const size_t begin = p.range.begin, n = p.range.size();
    if (Idle(config_, step_, begin)) continue;
    const ReplyRule& rule = RuleOf(rules, p.segment);
    ApplyRule(rule, absl::MakeSpan(replies[p.id]),
              absl::MakeSpan(x_).subspan(begin, n),
              absl::MakeSpan(m_).subspan(begin, n),
              absl::MakeSpan(v_).subspan(begin, n), {},
              rule.lamb ? absl::MakeSpan(v_fresh_).subspan(begin, n)
                        : absl::Span<float>());
  }
  const Optimizer& optimizer = OptimizerOf(config_);
  if (const LayerRule* layers = optimizer.Layers()) {
    // x moves by each layer's commit, from sums over the whole layer.
    const Range all{0, x_.size()};
    const std::vector<double> totals = LayerTotalsOf(
        config_, *layers, layout_, rules, all, x_, m_, v_, v_fresh_);
    const std::vector<double> commit =
        LayerCommit(config_, *layers, rules, totals, layer_state_);
    for (const Partition& p : layout_.partitions()) {
      MoveLayersX(config_, *layers, RuleOf(rules, p.segment), commit, all,
                  p.range.begin, p.range.size(), absl::MakeSpan(x_), m_, v_);
    }
    layer_state_ = optimizer.StateAfterCommit(config_, commit)[0];
  }
  diverged_ = false;
  ++step_;
  return absl::OkStatus();
}

namespace {

// A new x for ReplaceX or ReplaceWorkerX: `dim` finite values, or
// INVALID_ARGUMENT saying what is wrong.
absl::Status CheckNewX(absl::Span<const float> x, size_t dim) {
  if (x.size() != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("x has ", x.size(), " elements, not ", dim));
  }
  for (float f : x) {
    if (!std::isfinite(f))
      return absl::InvalidArgumentError("the new x holds Inf or NaN");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Simulator::ReplaceX(absl::Span<const float> x) {
  if (absl::Status s = CheckNewX(x, x_.size()); !s.ok()) return s;
  if (diverged_) {
    return absl::FailedPreconditionError(
        "the workers are inside a zero_one_adam local interval");
  }
  std::copy(x.begin(), x.end(), x_.begin());
  return absl::OkStatus();
}

absl::Status Simulator::ReplaceWorkerX(uint32_t rank,
                                       absl::Span<const float> x) {
  if (rank >= config_.workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " of ", config_.workers));
  }
  if (absl::Status s = CheckNewX(x, x_.size()); !s.ok()) return s;
  if (!diverged_) {
    return absl::FailedPreconditionError(
        "the workers are not inside a zero_one_adam local interval");
  }
  std::copy(x.begin(), x.end(), locals_[rank].x.begin());
  return absl::OkStatus();
}

absl::Span<const float> Simulator::worker_x(uint32_t rank) const {
  return diverged_ ? absl::MakeConstSpan(locals_[rank].x)
                   : absl::MakeConstSpan(x_);
}

absl::Span<const float> Simulator::worker_m(uint32_t rank) const {
  return diverged_ ? absl::MakeConstSpan(locals_[rank].m)
                   : absl::MakeConstSpan(m_);
}

}  // namespace morse::compress
