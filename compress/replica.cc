#include "compress/replica.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/compute_pool.h"
#include "compress/fnv.h"
#include "compress/kernels.h"
#include "compress/lamb.h"
#include "compress/optimizer.h"
#include "compress/scratch.h"
#include "compress/sign1_chunks.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {
namespace {

// g scaled by a worker's own clip factor (ClipsLocally), in this thread's
// scratch; g itself when the factor is 1.
absl::Span<const float> ScaledGradient(absl::Span<const float> g,
                                       float grad_scale) {
  if (grad_scale == 1.0f) return g;
  const absl::Span<float> scaled = Scratch(ScratchSlot::kLocalScaled, g.size());
  for (size_t j = 0; j < g.size(); ++j) scaled[j] = g[j] * grad_scale;
  return scaled;
}

// The statistics of a partition's layer segments, in SegmentStatsOf's
// order, computed behind an update that moves through the partition:
// Through(end) adds every segment that ends at or before global element
// `end`.
class SegmentsBehind {
 public:
  // `out` may be null: then nothing is computed.
  SegmentsBehind(const AlgorithmConfig& config, const ReplyRule& rule,
                 Range partition, Range held, absl::Span<const float> x,
                 absl::Span<const float> m, absl::Span<const float> v,
                 absl::Span<const float> fresh, std::vector<double>* out)
      : layers_(OptimizerOf(config).Layers()),
        rule_(rule),
        held_(held),
        x_(x),
        m_(m),
        v_(v),
        fresh_(fresh),
        out_(out) {
    if (out_ == nullptr) return;
    MORSE_CHECK(layers_ != nullptr);
    out_->clear();
    stats_.resize(layers_->stats());
    pieces_ = LayerPiecesOf(config, partition);
    if (!pieces_.empty()) at_ = pieces_[0].begin;
  }

  void Through(uint64_t end) {
    if (out_ == nullptr) return;
    for (; next_ < pieces_.size();) {
      const LayerPiece& piece = pieces_[next_];
      const uint64_t stop = std::min(at_ + kLayerSegment, piece.end);
      if (stop > end) return;
      const size_t j = at_ - held_.begin;
      layers_->SegmentStats(rule_, &x_[j], &m_[j], &v_[j], &fresh_[j],
                            stop - at_, stats_.data());
      out_->insert(out_->end(), stats_.begin(), stats_.end());
      at_ = stop;
      if (at_ == piece.end && ++next_ < pieces_.size())
        at_ = pieces_[next_].begin;
    }
  }

  bool done() const { return out_ == nullptr || next_ == pieces_.size(); }

 private:
  const LayerRule* const layers_;
  const ReplyRule& rule_;
  const Range held_;
  const absl::Span<const float> x_, m_, v_, fresh_;
  std::vector<double>* const out_;
  std::vector<double> stats_;
  std::vector<LayerPiece> pieces_;
  size_t next_ = 0;  // the piece of the next segment
  uint64_t at_ = 0;  // where the next segment starts
};

}  // namespace

void SelectByVariance(absl::Span<const float> v, absl::Span<float> values) {
  MORSE_CHECK(v.size() == values.size());
  for (size_t j = 0; j < v.size(); ++j)
    values[j] = simd::MaskedByVariance(true, v[j], values[j]);
}

void ApplyRule(const ReplyRule& rule, absl::Span<float> decoded,
               absl::Span<float> x, absl::Span<float> m, absl::Span<float> v,
               absl::Span<const float> anchor, absl::Span<float> v_fresh) {
  if (rule.grad_scale != 1.0f) {
    for (float& g : decoded) g *= rule.grad_scale;
  }
  if (rule.outer) {
    OuterStep(rule.outer_scalars, decoded, x, m);
    return;
  }
  if (rule.sync) {  // the mask in the same pass
    ZeroOneSyncStep(rule.scalars, decoded,
                    anchor.empty() ? absl::Span<const float>(x) : anchor, x, m,
                    v, rule.mask);
    return;
  }
  if (rule.lamb) {  // the mask in the same pass
    LambMoments(rule, decoded, m, v, v_fresh);
    return;
  }
  if (rule.frozen_variance) {  // the mask in the same pass
    FrozenVarianceStep(rule.scalars, decoded, x, m, v, rule.mask);
    return;
  }
  if (rule.mask) SelectByVariance(v, decoded);
  if (rule.bounded_variance) {
    ZeroOneVarianceStep(rule.scalars, decoded, x, m, v);
  } else {
    AdamStep(rule.scalars, decoded, x, m, v);
  }
}

uint64_t StateChecksum(std::initializer_list<absl::Span<const float>> arrays) {
  Fnv64 hash;
  for (absl::Span<const float> a : arrays)
    hash.MixWords(a.data(), a.size() * sizeof(float));
  return hash.value();
}

Replica::Replica(const AlgorithmConfig& config, Range range)
    : config_(config),
      range_(range),
      owned_x_(range.size(), 0.0f),
      m_(range.size(), 0.0f),
      v_(range.size(), 0.0f),
      x_(absl::MakeSpan(owned_x_)),
      lr_sums_(config.layout.cuts.size() + 1, 0.0f),
      zero_block_(std::max<uint64_t>(1, config.layout.block_elems)),
      zeros_(std::make_unique<Zeros>((range.size() + zero_block_ - 1) /
                                     zero_block_)) {
  InitLayers();
}

Replica::Replica(const AlgorithmConfig& config, Range range,
                 absl::Span<float> external_x)
    : config_(config),
      range_(range),
      m_(range.size(), 0.0f),
      v_(range.size(), 0.0f),
      x_(external_x),
      lr_sums_(config.layout.cuts.size() + 1, 0.0f),
      zero_block_(std::max<uint64_t>(1, config.layout.block_elems)),
      zeros_(std::make_unique<Zeros>((range.size() + zero_block_ - 1) /
                                     zero_block_)) {
  MORSE_CHECK(external_x.size() == range.size());
  InitLayers();
}

absl::Span<const float> Replica::VarianceMask(uint64_t begin,
                                              uint64_t n) const {
  MORSE_CHECK(begin >= range_.begin && begin + n <= range_.end);
  const uint64_t at = begin - range_.begin;
  const absl::Span<const float> mask = absl::MakeConstSpan(v_).subspan(at, n);
  if (n == 0) return {};
  const uint64_t generation =
      zeros_->generation.load(std::memory_order_relaxed);
  for (uint64_t b = at / zero_block_; b <= (at + n - 1) / zero_block_; ++b) {
    const uint64_t held = zeros_->blocks[b].load(std::memory_order_relaxed);
    uint64_t known = held >> 2 == generation ? held & 3 : kZerosUnknown;
    if (known == kZerosUnknown) {
      const uint64_t first = b * zero_block_;
      const uint64_t end = std::min<uint64_t>(first + zero_block_, v_.size());
      uint32_t zeros = 0;  // a count, which the compiler vectorizes
      for (uint64_t j = first; j < end; ++j) zeros += v_[j] == 0.0f;
      known = zeros > 0 ? kSomeZero : kNoZero;
      zeros_->blocks[b].store(generation << 2 | known,
                              std::memory_order_relaxed);
    }
    if (known == kSomeZero) return mask;
  }
  return {};
}

void Replica::ForgetZeros(uint64_t at, uint64_t n) {
  if (n == 0) return;
  for (uint64_t b = at / zero_block_; b <= (at + n - 1) / zero_block_; ++b)
    zeros_->blocks[b].store(kZerosUnknown, std::memory_order_relaxed);
}

absl::Status Replica::ApplyReply(int64_t step, uint64_t begin, uint64_t n,
                                 absl::Span<const uint8_t> reply,
                                 const StepHyper* hyper, float grad_scale,
                                 std::vector<double>* segment_stats,
                                 absl::Span<const ClipPiece> clip_pieces,
                                 bool amended) {
  if (begin < range_.begin || begin + n > range_.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reply range [", begin, ", ", begin + n, ") is outside the replica's [",
        range_.begin, ", ", range_.end, ")"));
  }
  if (Idle(config_, step, begin)) {  // nothing of it changes
    if (!reply.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a reply of ", reply.size(), " bytes for idle partition at ", begin));
    }
    return absl::OkStatus();
  }
  ReplyRule rule = PlanReply(config_, step, hyper, grad_scale);
  if (amended) rule.codec = CodecSpec{CodecKind::kFp32};
  const size_t offset = begin - range_.begin;
  MORSE_CHECK(segment_stats == nullptr || rule.lamb);
  // grad_scale scales the decoded values alone: the rule's scalars are
  // SegmentStats' own.
  SegmentsBehind segments(config_, rule, {begin, begin + n}, range_, x_, m_, v_,
                          v_fresh_, segment_stats);
  // Applies the decoded values of [begin + at, begin + at + len), then takes
  // the statistics of the segments that piece completes. A worker's sync
  // starts from x at the last sync (the anchor); a mirror's x is that.
  MORSE_CHECK(clip_pieces.empty() || grad_scale == 1.0f);
  // The rules that write v (ApplyRule): Adam's and 0/1 Adam's variance
  // steps, and LAMB's moments before its freeze.
  const bool writes_v = !rule.outer && !rule.sync && !rule.frozen_variance;
  // 1-bit LAMB's frozen moments read v for the mask alone: where no element
  // of the partition has v = 0 the mask selects nothing, and they skip v.
  ReplyRule applied = rule;
  if (rule.lamb && rule.frozen_variance && rule.mask &&
      VarianceMask(begin, n).empty()) {
    applied.mask = false;
  }
  const auto apply = [&](uint64_t at, absl::Span<float> decoded) {
    const uint64_t len = decoded.size();
    if (!clip_pieces.empty()) ScaleByPieces(clip_pieces, at, decoded);
    ApplyRule(applied, decoded, x_.subspan(offset + at, len),
              absl::MakeSpan(m_).subspan(offset + at, len),
              absl::MakeSpan(v_).subspan(offset + at, len),
              rule.sync && !anchor_.empty()
                  ? absl::MakeConstSpan(anchor_).subspan(offset + at, len)
                  : absl::Span<const float>(),
              rule.lamb ? absl::MakeSpan(v_fresh_).subspan(offset + at, len)
                        : absl::Span<float>());
    if (writes_v) ForgetZeros(offset + at, len);
    segments.Through(begin + at + len);
  };
  const uint64_t block = rule.codec.block_elems;
  if (rule.codec.kind == CodecKind::kSign1 && block > 0) {
    // A chunk of blocks at a time: its decoded values are still in L2 when
    // the update reads them (one pass over x, m, v instead of a decoded
    // partition written to memory and read back). Elementwise, so the bits
    // are those of decoding the whole partition first.
    if (absl::Status s = ValidatePayload(rule.codec, reply, n); !s.ok())
      return s;
    const uint64_t chunk = ChunkElems(block);
    const uint64_t blocks = (n + block - 1) / block;
    const absl::Span<float> decoded =
        Scratch(ScratchSlot::kReplyDecoded, std::min<uint64_t>(chunk, n));
    thread_local std::vector<float>
        scales;  // the payload's scales may be unaligned
    scales.resize(chunk / block);
    for (uint64_t at = 0; at < n; at += chunk) {
      const uint64_t len = std::min(chunk, n - at);
      std::memcpy(scales.data(), reply.data() + 4 * (at / block),
                  4 * ((len + block - 1) / block));
      ActiveKernels().sign1_decode(scales.data(),
                                   reply.data() + 4 * blocks + at / 8, len,
                                   block, decoded.data());
      apply(at, decoded.first(len));
    }
  } else if (const size_t width = ElementBytes(rule.codec.kind); width > 0) {
    // fp32/fp16/bf16 (the warmup): the same, a piece at a time.
    if (absl::Status s = ValidatePayload(rule.codec, reply, n); !s.ok())
      return s;
    constexpr uint64_t kPiece = 16384;
    const absl::Span<float> decoded =
        Scratch(ScratchSlot::kReplyDecoded, std::min(kPiece, n));
    for (uint64_t at = 0; at < n; at += kPiece) {
      const uint64_t len = std::min(kPiece, n - at);
      if (absl::Status s =
              Decode(rule.codec, reply.subspan(width * at, width * len),
                     decoded.first(len));
          !s.ok()) {
        return s;
      }
      apply(at, decoded.first(len));
    }
  } else {
    const absl::Span<float> decoded = Scratch(ScratchSlot::kReplyDecoded, n);
    if (absl::Status s = Decode(rule.codec, reply, decoded); !s.ok()) return s;
    apply(0, decoded);
  }
  MORSE_CHECK(segments.done());
  return absl::OkStatus();
}

void Replica::LocalMomentum(float beta1, uint64_t begin,
                            absl::Span<const float> g, absl::Span<float> out,
                            float grad_scale) const {
  g = ScaledGradient(g, grad_scale);
  compress::LocalMomentum(
      beta1, absl::MakeConstSpan(m_).subspan(begin - range_.begin, g.size()), g,
      out);
}

absl::Status Replica::LocalStep(int64_t step, absl::Span<const float> g,
                                absl::Span<const StepHyper> hypers,
                                float grad_scale, ComputePool* pool) {
  const absl::StatusOr<bool> starts =
      BeginLocalStep(config_, step, local_step_);
  if (!starts.ok()) return starts.status();
  if (g.size() != range_.size() || range_.begin != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a local step needs the whole model's gradient (",
                     range_.size(), " elements), got ", g.size()));
  }
  if (absl::Status s = CheckHyperCount(hypers, lr_sums_.size()); !s.ok())
    return s;
  const LocalPass pass = StartLocalStep(step, *starts, hypers);
  by_range_ = LocalPass{};  // this step's loop runs here
  g = ScaledGradient(g, grad_scale);
  // Element by element: chunks in parallel give the same bits.
  constexpr size_t kChunk = size_t{1} << 20;
  const size_t chunks = (g.size() + kChunk - 1) / kChunk;
  const auto chunk = [&](size_t i) {
    const size_t at = i * kChunk;
    RunLocalPass(pass, at, g.subspan(at, std::min(kChunk, g.size() - at)));
  };
  if (pool != nullptr && pool->threads() > 1 && chunks > 1) {
    pool->ParallelFor(chunks, chunk);
  } else {
    for (size_t i = 0; i < chunks; ++i) chunk(i);
  }
  local_step_ = step;
  return absl::OkStatus();
}

void Replica::RunLocalPass(const LocalPass& pass, size_t at,
                           absl::Span<const float> g, const AdamScalars* sync,
                           absl::Span<float> message) {
  MORSE_CHECK(sync == nullptr || (!pass.write_x && message.size() == g.size()));
  // Each segment's elements with its own lr and weight_decay (and its own
  // learning-rate sum in the message).
  ForEachSegmentPart(
      config_.layout, Range{at, at + g.size()}, [&](uint32_t k, Range part) {
        const size_t n = part.size();
        if (sync != nullptr) {
          ZeroOneSyncLocalStep(pass.scalars[k], *sync, lr_sums_[k],
                               g.subspan(part.begin - at, n),
                               x_.subspan(part.begin, n),
                               absl::MakeSpan(m_).subspan(part.begin, n),
                               absl::MakeSpan(u_).subspan(part.begin, n),
                               absl::MakeConstSpan(v_).subspan(part.begin, n),
                               pass.fresh, message.subspan(part.begin - at, n));
          return;
        }
        ZeroOneLocalStep(pass.scalars[k], g.subspan(part.begin - at, n),
                         x_.subspan(part.begin, n),
                         absl::MakeSpan(m_).subspan(part.begin, n),
                         absl::MakeSpan(u_).subspan(part.begin, n),
                         absl::MakeConstSpan(v_).subspan(part.begin, n),
                         pass.write_x, pass.fresh);
      });
}

Replica::LocalPass Replica::StartLocalStep(int64_t step, bool starts,
                                           absl::Span<const StepHyper> hypers) {
  const StepPlan plan = PlanStep(config_, step);
  if (starts) {
    // An interval of one step leaves x alone until its sync, which then
    // starts from x itself (no anchor: ApplyReply's empty anchor).
    if (plan.exchanges) {
      anchor_.clear();
    } else {
      anchor_.assign(x_.begin(), x_.end());
    }
    u_.resize(range_.size());  // read as +0 by the interval's first step
    std::fill(lr_sums_.begin(), lr_sums_.end(), 0.0f);
  }
  LocalPass pass{step, {}, /*fresh=*/starts, /*write_x=*/!plan.exchanges};
  for (uint32_t k = 0; k < lr_sums_.size(); ++k) {
    pass.scalars.push_back(LocalStepScalars(config_, step, HyperOf(hypers, k)));
    lr_sums_[k] += pass.scalars.back().lr;
  }
  return pass;
}

absl::Status Replica::BeginSyncLocalStep(int64_t step,
                                         absl::Span<const StepHyper> hypers) {
  const absl::StatusOr<bool> starts =
      BeginLocalStep(config_, step, local_step_);
  if (!starts.ok()) return starts.status();
  if (range_.begin != 0 || range_.end != config_.layout.dim) {
    return absl::FailedPreconditionError(
        "a local step needs the whole model's replica");
  }
  if (!PlanStep(config_, step).exchanges) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " does not sync"));
  }
  if (absl::Status s = CheckHyperCount(hypers, lr_sums_.size()); !s.ok())
    return s;
  by_range_ = StartLocalStep(step, *starts, hypers);
  local_step_ = step;
  return absl::OkStatus();
}

absl::Status Replica::LocalStepRange(int64_t step, uint64_t begin,
                                     absl::Span<const float> g,
                                     const AdamScalars* sync,
                                     absl::Span<float> message) {
  if (by_range_.step != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("no local step of step ", step, " begun by range"));
  }
  if (begin < range_.begin || begin > range_.end ||
      g.size() > range_.end - begin) {
    return absl::InvalidArgumentError(absl::StrCat("local step range [", begin,
                                                   ", ", begin + g.size(),
                                                   ") is outside the replica"));
  }
  if (sync != nullptr && message.size() != g.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a sync message of ", message.size(), " floats for ",
                     g.size(), " elements"));
  }
  RunLocalPass(by_range_, begin - range_.begin, g, sync, message);
  return absl::OkStatus();
}

std::vector<NamedState> Replica::SaveInterval() const {
  std::vector<NamedState> interval;
  for (const StateArray& array : OptimizerOf(config_).IntervalState(config_)) {
    NamedState& saved = interval.emplace_back();
    saved.name = array.name;
    if (array.name == "anchor") {
      saved.values = anchor_;
    } else if (array.name == "u") {
      if (!anchor_.empty()) saved.values = u_;
    } else {
      MORSE_CHECK(array.name == "lr_sum");
      saved.values = lr_sums_;
    }
  }
  return interval;
}

absl::Status Replica::RestoreInterval(absl::Span<const NamedState> interval,
                                      int64_t last_step) {
  if (absl::Status s =
          CheckInterval(config_, range_.size(), interval, "the local interval");
      !s.ok()) {
    return s;
  }
  by_range_ = LocalPass{};
  for (const NamedState& array : interval) {
    if (array.name == "anchor") {
      anchor_ = array.values;
    } else if (array.name == "u") {
      u_ = array.values;
    } else {
      MORSE_CHECK(array.name == "lr_sum");
      lr_sums_ = array.values;
    }
  }
  local_step_ = last_step;
  return absl::OkStatus();
}

void Replica::SyncMessage(int64_t step, const AdamScalars& s, uint64_t begin,
                          absl::Span<float> out) const {
  MORSE_CHECK(local_step_ == step && begin >= range_.begin &&
              begin + out.size() <= range_.end);
  // Each segment's elements with its own learning-rate sum.
  ForEachSegmentPart(
      config_.layout, Range{begin, begin + out.size()},
      [&](uint32_t k, Range part) {
        const size_t at = part.begin - range_.begin, n = part.size();
        ZeroOneSyncMessage(s, lr_sums_[k],
                           absl::MakeConstSpan(u_).subspan(at, n),
                           absl::MakeConstSpan(m_).subspan(at, n),
                           absl::MakeConstSpan(v_).subspan(at, n),
                           out.subspan(part.begin - begin, n));
      });
}

std::vector<NamedState> Replica::SaveState(uint64_t begin, uint64_t n) const {
  MORSE_CHECK(begin >= range_.begin && begin + n <= range_.end);
  std::vector<NamedState> state;
  for (const StateArray& array : OptimizerOf(config_).State(config_)) {
    NamedState& saved = state.emplace_back();
    saved.name = array.name;
    if (array.per_element) {
      const auto first = v_fresh_.begin() + (begin - range_.begin);
      saved.values.assign(first, first + n);
    } else {
      saved.values = layer_state_;
    }
  }
  return state;
}

absl::Status Replica::RestoreState(uint64_t begin, uint64_t n,
                                   absl::Span<const NamedState> state) {
  if (begin < range_.begin || begin + n > range_.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state range [", begin, ", ", begin + n, ") is outside the replica"));
  }
  if (absl::Status s = CheckState(config_, n, state, "the state"); !s.ok())
    return s;
  const std::vector<StateArray> arrays = OptimizerOf(config_).State(config_);
  for (size_t k = 0; k < state.size(); ++k) {  // CheckState: in order
    if (arrays[k].per_element) {
      std::copy(state[k].values.begin(), state[k].values.end(),
                v_fresh_.begin() + (begin - range_.begin));
    } else {
      layer_state_ = state[k].values;
    }
  }
  return absl::OkStatus();
}

void Replica::InitLayers() {
  const Optimizer& optimizer = OptimizerOf(config_);
  // A replica holds an optimizer's own state as a layer rule's alone
  // (Optimizer::Layers: one per-element array, then the layer state), the
  // shape SaveState and RestoreState map to its members.
  const std::vector<StateArray> arrays = optimizer.State(config_);
  if (optimizer.Layers() == nullptr) {
    MORSE_CHECK(arrays.empty());
    return;
  }
  MORSE_CHECK(arrays.size() == 2 && arrays[0].per_element &&
              !arrays[1].per_element);
  v_fresh_.assign(range_.size(), 0.0f);
  layer_state_ = optimizer.InitialState(config_, arrays[1]);
}

std::vector<double> Replica::SegmentStats(int64_t step, Range partition,
                                          const StepHyper* hyper) const {
  const LayerRule* layers = OptimizerOf(config_).Layers();
  MORSE_CHECK(layers != nullptr);
  return SegmentStatsOf(*layers, PlanReply(config_, step, hyper),
                        LayerPiecesOf(config_, partition), range_, x_, m_, v_,
                        v_fresh_);
}

absl::StatusOr<std::vector<double>> Replica::CommitStep(
    int64_t step, absl::Span<const StepHyper> hypers,
    absl::Span<const std::vector<double>> partition_stats, ComputePool* pool,
    const std::vector<bool>& moved) {
  const Optimizer& optimizer = OptimizerOf(config_);
  const LayerRule* layers = optimizer.Layers();
  if (layers == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        optimizer.name(), " has no layer rule: its steps commit nothing"));
  }
  if (!moved.empty() && moved.size() != LayerCount(config_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moved flags for ", moved.size(), " layers of ", LayerCount(config_)));
  }
  if (range_.begin != 0 || range_.end != config_.layout.dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a ", optimizer.name(), " commit needs the whole model's replica"));
  }
  absl::StatusOr<Layout> layout = Layout::Create(config_.layout);
  if (!layout.ok()) return layout.status();
  if (!partition_stats.empty() &&
      partition_stats.size() != layout->partitions().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece statistics of ", partition_stats.size(),
        " partitions for a layout of ", layout->partitions().size()));
  }
  if (absl::Status s = CheckHyperCount(hypers, layout->segment_count());
      !s.ok()) {
    return s;
  }
  const std::vector<ReplyRule> rules = PlanReplies(config_, step, hypers);
  // Each partition's pieces in partition order: the order LayerTotals adds.
  std::vector<LayerPiece> pieces;
  std::vector<double> stats;
  for (const Partition& p : layout->partitions()) {
    const std::vector<LayerPiece> of = LayerPiecesOf(config_, p.range);
    pieces.insert(pieces.end(), of.begin(), of.end());
    const bool given =
        !partition_stats.empty() && !partition_stats[p.id].empty();
    for (const LayerPiece& piece : of) {
      // Its x has moved: statistics from now would be another step's.
      if (!given && !moved.empty() && moved[piece.layer]) {
        return absl::InvalidArgumentError(
            absl::StrCat("partition ", p.id, " holds moved layer ", piece.layer,
                         " but has no statistics"));
      }
    }
    const std::vector<double> computed =
        given ? std::vector<double>()
              : PieceStats(*layers, of,
                           SegmentStatsOf(*layers, RuleOf(rules, p.segment), of,
                                          range_, x_, m_, v_, v_fresh_));
    const std::vector<double>& these = given ? partition_stats[p.id] : computed;
    if (these.size() != layers->stats() * of.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("partition ", p.id, " has ", of.size(), " pieces, got ",
                       these.size(), " statistics"));
    }
    stats.insert(stats.end(), these.begin(), these.end());
  }
  const std::vector<double> totals =
      LayerTotals(config_, *layers, pieces, stats);
  std::vector<double> commit =
      LayerCommit(config_, *layers, rules, totals, layer_state_);
  if (absl::Status s = ValidateCommitOfLayers(config_, *layers, commit);
      !s.ok()) {
    return s;
  }
  // x moves element by element: partitions in parallel give the same bits.
  // The layers MoveLayer moved are left out.
  const auto& partitions = layout->partitions();
  const auto update = [&](size_t i) {
    const Partition& p = partitions[i];
    const ReplyRule rule = PlanReply(config_, step, HyperOf(hypers, p.segment));
    for (const LayerPiece& piece : LayerPiecesOf(config_, p.range)) {
      if (moved.empty() || !moved[piece.layer]) {
        MoveLayersX(config_, *layers, rule, commit, range_, piece.begin,
                    piece.end - piece.begin, x_, m_, v_);
      }
    }
  };
  if (pool != nullptr && pool->threads() > 1) {
    pool->ParallelFor(partitions.size(), update);
  } else {
    for (size_t i = 0; i < partitions.size(); ++i) update(i);
  }
  layer_state_ = optimizer.StateAfterCommit(config_, commit)[0];
  return commit;
}

absl::Status Replica::MoveLayer(int64_t step, size_t layer,
                                const StepHyper* hyper,
                                absl::Span<const double> piece_stats) {
  const Optimizer& optimizer = OptimizerOf(config_);
  const LayerRule* layers = optimizer.Layers();
  if (layers == nullptr || range_.begin != 0 ||
      range_.end != config_.layout.dim) {
    return absl::FailedPreconditionError(
        "MoveLayer is for a worker's whole replica of an optimizer with a "
        "layer rule");
  }
  if (layer >= LayerCount(config_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " of ", LayerCount(config_)));
  }
  absl::StatusOr<Layout> layout = Layout::Create(config_.layout);
  if (!layout.ok()) return layout.status();
  // The layer's pieces in partition order, as LayerTotals adds them, from
  // the partitions it overlaps alone (called once per layer and step).
  const std::vector<uint64_t> bounds = LayerBounds(config_);
  std::vector<LayerPiece> pieces;
  for (const Partition& p : layout->partitions()) {
    if (p.range.end <= bounds[layer] || p.range.begin >= bounds[layer + 1])
      continue;
    for (const LayerPiece& piece : LayerPiecesOf(config_, p.range)) {
      if (piece.layer != layer) continue;
      pieces.push_back(piece);
    }
  }
  const size_t k = layers->stats(), c = layers->commit_values();
  if (piece_stats.size() != k * pieces.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " has ", pieces.size(), " pieces, got ",
                     piece_stats.size(), " statistics"));
  }
  const ReplyRule rule = PlanReply(config_, step, hyper);
  const std::vector<double> totals =
      LayerTotals(config_, *layers, pieces, piece_stats);
  std::vector<double> mine(c);
  layers->Commit(config_, rule, &totals[k * layer], layer, layer_state_,
                 mine.data());
  if (absl::Status s = layers->ValidateLayer(layer, mine); !s.ok()) return s;
  for (const LayerPiece& piece : pieces) {
    const size_t j = piece.begin - range_.begin;
    layers->MoveX(rule, mine.data(), &x_[j], &m_[j], &v_[j],
                  piece.end - piece.begin);
  }
  return absl::OkStatus();
}

absl::Status Replica::ApplyCommit(int64_t step, uint64_t begin, uint64_t n,
                                  absl::Span<const double> commit,
                                  const StepHyper* hyper) {
  const Optimizer& optimizer = OptimizerOf(config_);
  const LayerRule* layers = optimizer.Layers();
  if (layers == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a layer commit for ", optimizer.name(), ", which has no layer rule"));
  }
  if (begin < range_.begin || begin + n > range_.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "commit range [", begin, ", ", begin + n, ") is outside the replica"));
  }
  if (absl::Status s = ValidateCommitOfLayers(config_, *layers, commit);
      !s.ok()) {
    return s;
  }
  MoveLayersX(config_, *layers, PlanReply(config_, step, hyper), commit, range_,
              begin, n, x_, m_, v_);
  return absl::OkStatus();
}

}  // namespace morse::compress
