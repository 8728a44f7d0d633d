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
#include "compress/simd/element_ops.h"

namespace morse::compress {
namespace {

// Whole blocks of about 32K elements (128 KiB of floats): what the chunked
// sign1 encode and reply update keep in L2 between their two halves.
uint64_t ChunkElems(uint64_t block) {
  constexpr uint64_t kTarget = uint64_t{1} << 15;
  return block * std::max<uint64_t>(1, kTarget / block);
}

// A sign1 payload of n elements holds every block's scale, then the bits
// (design.md 2.3), so a chunk of whole blocks (len elements from element
// `at`; block_elems is a multiple of 16, so its bits start on a byte) lies
// in two places. CutSign1Chunk copies it out into a payload of its own
// (PayloadBytes of len), PutSign1Chunk copies such a payload back in.
void CutSign1Chunk(const uint8_t* whole, uint64_t n, uint64_t block,
                   uint64_t at, uint64_t len, uint8_t* part) {
  const uint64_t blocks = (n + block - 1) / block,
                 part_blocks = (len + block - 1) / block;
  std::memcpy(part, whole + 4 * (at / block), 4 * part_blocks);
  std::memcpy(part + 4 * part_blocks, whole + 4 * blocks + at / 8,
              (len + 7) / 8);
}

void PutSign1Chunk(const uint8_t* part, uint64_t n, uint64_t block, uint64_t at,
                   uint64_t len, uint8_t* whole) {
  const uint64_t blocks = (n + block - 1) / block,
                 part_blocks = (len + block - 1) / block;
  std::memcpy(whole + 4 * (at / block), part, 4 * part_blocks);
  std::memcpy(whole + 4 * blocks + at / 8, part + 4 * part_blocks,
              (len + 7) / 8);
}

// g scaled by a worker's own clip factor (ClipsLocally), in this thread's
// scratch; g itself when the factor is 1.
absl::Span<const float> ScaledGradient(absl::Span<const float> g,
                                       float grad_scale) {
  if (grad_scale == 1.0f) return g;
  const absl::Span<float> scaled = Scratch(ScratchSlot::kLocalScaled, g.size());
  for (size_t j = 0; j < g.size(); ++j) scaled[j] = g[j] * grad_scale;
  return scaled;
}

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
      x_(absl::MakeSpan(owned_x_)) {
  InitLamb();
}

Replica::Replica(const AlgorithmConfig& config, Range range,
                 absl::Span<float> external_x)
    : config_(config),
      range_(range),
      m_(range.size(), 0.0f),
      v_(range.size(), 0.0f),
      x_(external_x) {
  MORSE_CHECK(external_x.size() == range.size());
  InitLamb();
}

absl::Status Replica::ApplyReply(int64_t step, uint64_t begin, uint64_t n,
                                 absl::Span<const uint8_t> reply,
                                 const StepHyper* hyper, float grad_scale) {
  if (begin < range_.begin || begin + n > range_.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reply range [", begin, ", ", begin + n, ") is outside the replica's [",
        range_.begin, ", ", range_.end, ")"));
  }
  const ReplyRule rule = PlanReply(config_, step, hyper, grad_scale);
  const size_t offset = begin - range_.begin;
  // A worker's sync starts from x at the last sync; a mirror's x is that.
  const auto anchor = [&](uint64_t at, uint64_t len) {
    return rule.sync && !anchor_.empty()
               ? absl::MakeConstSpan(anchor_).subspan(offset + at, len)
               : absl::Span<const float>();
  };
  const auto fresh = [&](uint64_t at, uint64_t len) {
    return rule.lamb ? absl::MakeSpan(v_fresh_).subspan(offset + at, len)
                     : absl::Span<float>();
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
      ApplyRule(rule, decoded.first(len), x_.subspan(offset + at, len),
                absl::MakeSpan(m_).subspan(offset + at, len),
                absl::MakeSpan(v_).subspan(offset + at, len), anchor(at, len),
                fresh(at, len));
    }
    return absl::OkStatus();
  }
  if (const size_t width = ElementBytes(rule.codec.kind); width > 0) {
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
      ApplyRule(rule, decoded.first(len), x_.subspan(offset + at, len),
                absl::MakeSpan(m_).subspan(offset + at, len),
                absl::MakeSpan(v_).subspan(offset + at, len), anchor(at, len),
                fresh(at, len));
    }
    return absl::OkStatus();
  }
  const absl::Span<float> decoded = Scratch(ScratchSlot::kReplyDecoded, n);
  if (absl::Status s = Decode(rule.codec, reply, decoded); !s.ok()) return s;
  ApplyRule(rule, decoded, x_.subspan(offset, n),
            absl::MakeSpan(m_).subspan(offset, n),
            absl::MakeSpan(v_).subspan(offset, n), anchor(0, n), fresh(0, n));
  return absl::OkStatus();
}

absl::Status EncodeWorkerMessage(const SendRule& rule, const Replica& replica,
                                 ErrorFeedback& error, uint64_t begin,
                                 absl::Span<const float> g, float grad_scale,
                                 absl::Span<uint8_t> payload) {
  const uint64_t n = g.size();
  const auto mask = [&](uint64_t at, uint64_t len) {
    return rule.mask ? replica.v().subspan(at - replica.range().begin, len)
                     : absl::Span<const float>();
  };
  if (rule.accumulated) {  // zero_one_adam's sync: the gradient is already in u
    const absl::Span<float> message = Scratch(ScratchSlot::kLocalMomentum, n);
    replica.SyncMessage(rule.step, begin, message);
    return error.Compress(rule.codec, begin, message, rule.key, payload,
                          mask(begin, n));
  }
  if (grad_scale != 1.0f && !rule.local_momentum) {
    return absl::FailedPreconditionError(
        "a worker scales its own gradient only in the compression phase");
  }
  if (!rule.local_momentum) {
    return rule.feedback ? error.Compress(rule.codec, begin, g, rule.key,
                                          payload, mask(begin, n))
                         : Encode(rule.codec, g, rule.key, payload);
  }
  const uint64_t block = rule.codec.block_elems;
  if (rule.codec.kind != CodecKind::kSign1 || !rule.feedback || block == 0) {
    const absl::Span<float> local = Scratch(ScratchSlot::kLocalMomentum, n);
    replica.LocalMomentum(begin, g, local, grad_scale);
    return rule.feedback ? error.Compress(rule.codec, begin, local, rule.key,
                                          payload, mask(begin, n))
                         : Encode(rule.codec, local, rule.key, payload);
  }
  if (payload.size() != PayloadBytes(rule.codec, n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a payload of ", payload.size(), " bytes for ", n,
                     " elements of ", CodecName(rule.codec.kind)));
  }
  // A chunk of whole blocks encodes into its own small payload, put in its
  // place in the whole one (PutSign1Chunk).
  const uint64_t chunk = ChunkElems(block);
  const absl::Span<float> local =
      Scratch(ScratchSlot::kLocalMomentum, std::min(chunk, n));
  thread_local std::vector<uint8_t> part;
  for (uint64_t at = 0; at < n; at += chunk) {
    const uint64_t len = std::min(chunk, n - at);
    const absl::Span<float> u = local.first(len);
    replica.LocalMomentum(begin + at, g.subspan(at, len), u, grad_scale);
    part.resize(PayloadBytes(rule.codec, len));
    if (absl::Status s =
            error.Compress(rule.codec, begin + at, u, rule.key,
                           absl::MakeSpan(part), mask(begin + at, len));
        !s.ok()) {
      return s;
    }
    PutSign1Chunk(part.data(), n, block, at, len, payload.data());
  }
  return absl::OkStatus();
}

absl::Status EncodeShardReply(
    const SendRule& rule, const CodecSpec& up,
    absl::Span<const absl::Span<const uint8_t>> pushes, ErrorFeedback& error,
    uint64_t offset, uint64_t n, absl::Span<const float> mask_v,
    absl::Span<uint8_t> payload) {
  const uint64_t block = rule.codec.block_elems;
  const bool chunked =
      rule.feedback && rule.codec.kind == CodecKind::kSign1 &&
      up.kind == CodecKind::kSign1 && block > 0 && up.block_elems == block &&
      offset % block == 0 &&
      (n % block == 0 ||
       offset + n == error.size()) &&  // RestoreRange's alignment
      error.spec().kind != FeedbackKind::kNone &&
      error.spec().storage == ErrorStorage::kFp32;
  const size_t up_width = ElementBytes(up.kind);
  const size_t down_width = ElementBytes(rule.codec.kind);
  if (!rule.feedback && up_width > 0 && down_width > 0) {
    // fp32/fp16/bf16 both ways, no error (the warmup): a piece of the average
    // at a time, encoded while it is in cache; every element as in the
    // whole-partition average and encode.
    if (payload.size() != PayloadBytes(rule.codec, n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a reply of ", payload.size(), " bytes for ", n, " elements"));
    }
    for (const auto& push : pushes) {
      if (push.size() != PayloadBytes(up, n)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a push of ", push.size(), " bytes for ", n, " elements"));
      }
    }
    constexpr uint64_t kPiece = 16384;
    const absl::Span<float> average =
        Scratch(ScratchSlot::kShardAverage, std::min(kPiece, n));
    thread_local std::vector<absl::Span<const uint8_t>> views;
    views.resize(pushes.size());
    for (uint64_t at = 0; at < n; at += kPiece) {
      const uint64_t len = std::min(kPiece, n - at);
      for (size_t i = 0; i < pushes.size(); ++i)
        views[i] = pushes[i].subspan(up_width * at, up_width * len);
      const absl::Span<float> u = average.first(len);
      if (absl::Status s = DecodeAverage(up, views, u); !s.ok()) return s;
      RoundingKey key = rule.key;
      key.first_index += at;
      if (absl::Status s =
              Encode(rule.codec, u, key,
                     payload.subspan(down_width * at, down_width * len));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  if (!chunked) {
    const absl::Span<float> average = Scratch(ScratchSlot::kShardAverage, n);
    if (absl::Status s = DecodeAverage(up, pushes, average); !s.ok()) return s;
    return rule.feedback ? error.CompressOrKeep(rule.codec, offset, average,
                                                rule.key, payload, mask_v)
                         : Encode(rule.codec, average, rule.key, payload);
  }
  if (payload.size() != PayloadBytes(rule.codec, n) ||
      (!mask_v.empty() && mask_v.size() != n) || offset > error.size() ||
      n > error.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a reply of ", payload.size(), " bytes for ", n, " elements at ",
        offset, " of an error buffer of ", error.size()));
  }
  for (const auto& push : pushes) {
    if (push.size() != PayloadBytes(up, n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a push of ", push.size(), " bytes for ", n, " elements"));
    }
  }
  // A chunk of whole blocks is cut out of each push into a small payload of
  // its own (CutSign1Chunk), averaged, and encoded into another, put in its
  // place in the reply (PutSign1Chunk).
  const uint64_t chunk = ChunkElems(block);
  const absl::Span<float> average =
      Scratch(ScratchSlot::kShardAverage, std::min(chunk, n));
  const absl::Span<float> backup = Scratch(ScratchSlot::kErrorBackup, n);
  thread_local std::vector<std::vector<uint8_t>> parts;
  thread_local std::vector<absl::Span<const uint8_t>> views;
  thread_local std::vector<uint8_t> out;
  if (parts.size() < pushes.size()) parts.resize(pushes.size());
  views.resize(pushes.size());
  for (uint64_t at = 0; at < n; at += chunk) {
    const uint64_t len = std::min(chunk, n - at);
    for (size_t i = 0; i < pushes.size(); ++i) {
      parts[i].resize(PayloadBytes(up, len));
      CutSign1Chunk(pushes[i].data(), n, block, at, len, parts[i].data());
      views[i] = absl::MakeConstSpan(parts[i]);
    }
    const absl::Span<float> u = average.first(len);
    absl::Status status = DecodeAverage(up, views, u);
    error.Read(offset + at,
               backup.subspan(at, len));  // now in cache for Compress too
    out.resize(PayloadBytes(rule.codec, len));
    if (status.ok()) {
      RoundingKey key = rule.key;
      key.first_index += at;
      status =
          error.Compress(rule.codec, offset + at, u, key, absl::MakeSpan(out),
                         mask_v.empty() ? mask_v : mask_v.subspan(at, len));
    }
    if (!status.ok()) {
      MORSE_CHECK(error.RestoreRange(offset, backup.first(at + len)).ok());
      return status;
    }
    PutSign1Chunk(out.data(), n, block, at, len, payload.data());
  }
  return absl::OkStatus();
}

void Replica::LocalMomentum(uint64_t begin, absl::Span<const float> g,
                            absl::Span<float> out, float grad_scale) const {
  g = ScaledGradient(g, grad_scale);
  compress::LocalMomentum(
      config_.adam.beta1,
      absl::MakeConstSpan(m_).subspan(begin - range_.begin, g.size()), g, out);
}

absl::Status Replica::LocalStep(int64_t step, absl::Span<const float> g,
                                const StepHyper* hyper, float grad_scale,
                                ComputePool* pool) {
  const absl::StatusOr<bool> starts =
      BeginLocalStep(config_, step, local_step_);
  if (!starts.ok()) return starts.status();
  if (g.size() != range_.size() || range_.begin != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a local step needs the whole model's gradient (",
                     range_.size(), " elements), got ", g.size()));
  }
  const LocalPass pass = StartLocalStep(step, *starts, hyper);
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
  lr_sum_ += pass.scalars.lr;
  local_step_ = step;
  return absl::OkStatus();
}

void Replica::RunLocalPass(const LocalPass& pass, size_t at,
                           absl::Span<const float> g) {
  const size_t n = g.size();
  ZeroOneLocalStep(
      pass.scalars, g, x_.subspan(at, n), absl::MakeSpan(m_).subspan(at, n),
      absl::MakeSpan(u_).subspan(at, n), absl::MakeConstSpan(v_).subspan(at, n),
      pass.write_x, pass.fresh);
}

Replica::LocalPass Replica::StartLocalStep(int64_t step, bool starts,
                                           const StepHyper* hyper) {
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
    lr_sum_ = 0.0f;
  }
  return LocalPass{step, LocalStepScalars(config_, step, hyper),
                   /*fresh=*/starts,
                   /*write_x=*/!plan.exchanges};
}

absl::StatusOr<float> Replica::BeginSyncLocalStep(int64_t step,
                                                  const StepHyper* hyper) {
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
  by_range_ = StartLocalStep(step, *starts, hyper);
  lr_sum_ += by_range_.scalars.lr;
  local_step_ = step;
  return lr_sum_;
}

absl::Status Replica::LocalStepRange(int64_t step, uint64_t begin,
                                     absl::Span<const float> g) {
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
  RunLocalPass(by_range_, begin - range_.begin, g);
  return absl::OkStatus();
}

absl::Status Replica::RestoreLocalInterval(LocalInterval interval) {
  if (interval.anchor.size() != interval.u.size() ||
      (!interval.anchor.empty() && interval.anchor.size() != range_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a local interval of ", interval.anchor.size(), " and ",
        interval.u.size(), " elements for a replica of ", range_.size()));
  }
  by_range_ = LocalPass{};
  anchor_ = std::move(interval.anchor);
  u_ = std::move(interval.u);
  lr_sum_ = interval.lr_sum;
  local_step_ = interval.last_step;
  return absl::OkStatus();
}

void Replica::SyncMessage(int64_t step, uint64_t begin,
                          absl::Span<float> out) const {
  MORSE_CHECK(local_step_ == step && begin >= range_.begin &&
              begin + out.size() <= range_.end);
  const size_t at = begin - range_.begin;
  const AdamScalars s = LocalStepScalars(config_, step, nullptr);
  ZeroOneSyncMessage(s, lr_sum_,
                     absl::MakeConstSpan(u_).subspan(at, out.size()),
                     absl::MakeConstSpan(m_).subspan(at, out.size()),
                     absl::MakeConstSpan(v_).subspan(at, out.size()), out);
}

std::vector<NamedState> Replica::SaveState(uint64_t begin, uint64_t n) const {
  MORSE_CHECK(begin >= range_.begin && begin + n <= range_.end);
  std::vector<NamedState> state;
  for (const StateArray& array : OptimizerOf(config_).State(config_)) {
    NamedState& saved = state.emplace_back();
    saved.name = array.name;
    if (array.name == "v_fresh") {
      const auto first = v_fresh_.begin() + (begin - range_.begin);
      saved.values.assign(first, first + n);
    } else {
      MORSE_CHECK(array.name == "lamb_layers");
      saved.values = FlattenLambLayers(lamb_layers_);
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
  for (const NamedState& array : state) {
    if (array.name == "v_fresh") {
      std::copy(array.values.begin(), array.values.end(),
                v_fresh_.begin() + (begin - range_.begin));
    } else {
      MORSE_CHECK(array.name == "lamb_layers");
      lamb_layers_ = UnflattenLambLayers(array.values);
    }
  }
  return absl::OkStatus();
}

void Replica::InitLamb() {
  if (config_.optimizer != OptimizerKind::kOneBitLamb) return;
  v_fresh_.assign(range_.size(), 0.0f);
  lamb_layers_.resize(LayerCount(config_));
}

std::vector<double> Replica::LambSegments(int64_t step, Range partition,
                                          const StepHyper* hyper) const {
  return LambSegmentsOf(PlanReply(config_, step, hyper),
                        LambPiecesOf(config_, partition), range_, x_, m_, v_,
                        v_fresh_);
}

absl::StatusOr<std::vector<double>> Replica::LambStep(
    int64_t step, const StepHyper* hyper,
    absl::Span<const std::vector<double>> partition_segments,
    ComputePool* pool) {
  if (config_.optimizer != OptimizerKind::kOneBitLamb) {
    return absl::FailedPreconditionError("LambStep is for onebit_lamb");
  }
  if (range_.begin != 0 || range_.end != config_.layout.dim) {
    return absl::FailedPreconditionError(
        "a onebit_lamb commit needs the whole model's replica");
  }
  absl::StatusOr<Layout> layout = Layout::Create(config_.layout);
  if (!layout.ok()) return layout.status();
  if (!partition_segments.empty() &&
      partition_segments.size() != layout->partitions().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment statistics of ", partition_segments.size(),
        " partitions for a layout of ", layout->partitions().size()));
  }
  const ReplyRule rule = PlanReply(config_, step, hyper);
  // Each partition's segments in partition order: the order LambTotals sums.
  std::vector<LambPiece> pieces;
  std::vector<double> segments;
  for (const Partition& p : layout->partitions()) {
    const std::vector<LambPiece> of = LambPiecesOf(config_, p.range);
    pieces.insert(pieces.end(), of.begin(), of.end());
    uint64_t count = 0;
    for (const LambPiece& piece : of) count += piece.segments();
    const bool given =
        !partition_segments.empty() && !partition_segments[p.id].empty();
    const std::vector<double> computed =
        given ? std::vector<double>()
              : LambSegmentsOf(rule, of, range_, x_, m_, v_, v_fresh_);
    const std::vector<double>& these =
        given ? partition_segments[p.id] : computed;
    if (these.size() != kLambStats * count) {
      return absl::InvalidArgumentError(
          absl::StrCat("partition ", p.id, " has ", count, " segments, got ",
                       these.size(), " statistics"));
    }
    segments.insert(segments.end(), these.begin(), these.end());
  }
  const std::vector<double> totals =
      LambTotalsOfSegments(config_, pieces, segments);
  std::vector<double> commit = LambCommit(config_, rule, totals, lamb_layers_);
  if (absl::Status s = ValidateLambCommit(config_, commit); !s.ok()) return s;
  // x moves element by element: partitions in parallel give the same bits.
  const auto& partitions = layout->partitions();
  const auto update = [&](size_t i) {
    MORSE_CHECK(ApplyCommit(step, partitions[i].range.begin,
                            partitions[i].range.size(), commit, hyper)
                    .ok());
  };
  if (pool != nullptr && pool->threads() > 1) {
    pool->ParallelFor(partitions.size(), update);
  } else {
    for (size_t i = 0; i < partitions.size(); ++i) update(i);
  }
  lamb_layers_ = LambStateOf(commit);
  return commit;
}

absl::Status Replica::ApplyCommit(int64_t step, uint64_t begin, uint64_t n,
                                  absl::Span<const double> commit,
                                  const StepHyper* hyper) {
  if (config_.optimizer != OptimizerKind::kOneBitLamb) {
    return absl::FailedPreconditionError(
        "a onebit_lamb commit for another optimizer");
  }
  if (begin < range_.begin || begin + n > range_.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "commit range [", begin, ", ", begin + n, ") is outside the replica"));
  }
  if (absl::Status s = ValidateLambCommit(config_, commit); !s.ok()) return s;
  LambUpdateX(config_, PlanReply(config_, step, hyper), commit, range_, begin,
              n, x_, m_, v_);
  return absl::OkStatus();
}

}  // namespace morse::compress
