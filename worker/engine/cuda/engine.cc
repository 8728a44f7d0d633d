#include "worker/engine/cuda/engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/optimizer.h"
#include "compress/sync.h"
#include "compress/update_rules.h"
#include "kernels/codecs.h"
#include "kernels/device.h"
#include "kernels/layers.h"
#include "kernels/mlp.h"

namespace morse::worker::cuda {
namespace {

// MlpOps (worker/mlp_backprop.h) through kernels/mlp.h, on one context; the
// cuBLAS handle and the per-row loss buffer are made on first use.
class DeviceMlpOps final : public MlpOps {
 public:
  explicit DeviceMlpOps(kernels::Context& ctx) : ctx_(ctx) {}

  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                    const float* a, int lda, const float* b, int ldb,
                    float beta, float* c, int ldc) override {
    if (blas_ == nullptr) {
      auto blas = kernels::Blas::Create(ctx_);
      if (!blas.ok()) return blas.status();
      blas_ = *std::move(blas);
    }
    return blas_->Gemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
  }
  absl::Status BroadcastRows(const float* bias, int rows, int cols,
                             float* out) override {
    return kernels::BroadcastRows(ctx_, bias, rows, cols, out);
  }
  absl::Status Relu(float* z, size_t n) override {
    return kernels::Relu(ctx_, z, n);
  }
  absl::Status ReluBackward(const float* a, float* da, size_t n) override {
    return kernels::ReluBackward(ctx_, a, da, n);
  }
  absl::StatusOr<double> SoftmaxCrossEntropy(const float* logits,
                                             const uint32_t* labels, int rows,
                                             int classes, float* dz) override {
    if (row_loss_.bytes() < 8 * static_cast<size_t>(rows)) {
      auto buffer =
          kernels::DeviceBuffer::Allocate(8 * static_cast<size_t>(rows));
      if (!buffer.ok()) return buffer.status();
      row_loss_ = *std::move(buffer);
    }
    return kernels::SoftmaxCrossEntropy(ctx_, logits, labels, rows, classes, dz,
                                        row_loss_.as<double>());
  }
  absl::Status ColumnSums(const float* in, int rows, int cols,
                          float* out) override {
    return kernels::ColumnSums(ctx_, in, rows, cols, out);
  }

 private:
  kernels::Context& ctx_;
  std::unique_ptr<kernels::Blas> blas_;
  kernels::DeviceBuffer row_loss_;  // one double per batch row
};

bool OnGpu(compress::CodecKind kind) {
  return kind != compress::CodecKind::kTopK;
}

class CudaEngine final : public Engine, public DeviceServices {
 public:
  CudaEngine(const EngineState& state, std::string description,
             DeviceArrays arrays)
      : config_(*state.config),
        layout_(*state.layout),
        description_(std::move(description)),
        arrays_(arrays) {}

  absl::Status Init() {
    auto device = kernels::CurrentDevice();
    if (!device.ok()) return device.status();
    device_ = *device;
    const size_t dim = config_.layout.dim;
    for (kernels::DeviceBuffer* b :
         {&x_, &m_, &v_, &e_, &grad_, &scratch_, &apply_scratch_}) {
      const bool external = (b == &x_ && arrays_.x != nullptr) ||
                            (b == &grad_ && arrays_.grad != nullptr);
      if (external) continue;
      auto allocated = kernels::DeviceBuffer::Allocate(4 * dim);
      if (!allocated.ok()) return allocated.status();
      *b = *std::move(allocated);
    }
    x_ptr_ = arrays_.x != nullptr ? arrays_.x : x_.as<float>();
    grad_ptr_ = arrays_.grad != nullptr ? arrays_.grad : grad_.as<float>();
    // One staging slot per partition, so that every partition can be in
    // flight at once: its encode's payload and then its reply, on the device
    // and pinned on the host (a partition's reply lands after its push has
    // left), and its encode's flag.
    size_t total = 0;
    for (const compress::Partition& p : layout_.partitions()) {
      size_t bytes = 0;
      for (const compress::CodecSpec* spec :
           {&config_.warmup_codec, &config_.up_codec, &config_.down_codec}) {
        bytes = std::max(bytes, compress::PayloadBytes(*spec, p.range.size()));
      }
      auto encoded = kernels::Event::Create();
      if (!encoded.ok()) return encoded.status();
      slots_.push_back(Slot{total, *std::move(encoded), 0});
      total += (bytes + 255) / 256 * 256;
    }
    const size_t flag_bytes = sizeof(int) * std::max<size_t>(1, slots_.size());
    for (auto [buffer, bytes] :
         {std::pair{&payloads_, total}, std::pair{&flags_, flag_bytes}}) {
      auto allocated = kernels::DeviceBuffer::Allocate(bytes);
      if (!allocated.ok()) return allocated.status();
      *buffer = *std::move(allocated);
    }
    for (auto [buffer, bytes] : {std::pair{&payloads_host_, total},
                                 std::pair{&flags_host_, flag_bytes}}) {
      auto allocated = kernels::PinnedBuffer::Allocate(bytes);
      if (!allocated.ok()) return allocated.status();
      *buffer = *std::move(allocated);
    }
    // The clip's sums, also without clip_grad_norm: a script's
    // clip_grad_norm_ clips a step too (Session::SetStepClipping).
    {
      const size_t bytes =
          sizeof(double) *
          std::max<size_t>(
              1, (dim + compress::kSumSegment - 1) / compress::kSumSegment);
      auto sums = kernels::DeviceBuffer::Allocate(bytes);
      if (!sums.ok()) return sums.status();
      square_sums_ = *std::move(sums);
      auto host = kernels::PinnedBuffer::Allocate(bytes);
      if (!host.ok()) return host.status();
      square_sums_host_ = *std::move(host);
    }
    if (absl::Status s = e_.Fill(0); !s.ok()) return s;
    // The optimizer's own arrays and those of its local interval: each
    // per-element one on the device (+0 to start), the others on the host
    // at their starting values.
    const compress::Optimizer& optimizer = compress::OptimizerOf(config_);
    for (auto [arrays, owned] :
         {std::pair{optimizer.State(config_), &state_},
          std::pair{optimizer.IntervalState(config_), &interval_}}) {
      for (const compress::StateArray& array : arrays) {
        OwnState& own = owned->emplace_back();
        own.array = array;
        if (!array.per_element) {
          own.host = optimizer.InitialState(config_, array);
          continue;
        }
        auto allocated = kernels::DeviceBuffer::Allocate(4 * dim);
        if (!allocated.ok()) return allocated.status();
        own.device = *std::move(allocated);
        if (absl::Status s = own.device.Fill(0); !s.ok()) return s;
      }
    }
    if (compress::CommitsLayers(config_)) {
      // Each segment of the layout (a parameter group) its own table, of
      // its partitions' pieces in partition order. Partitions lie in element
      // order and no partition straddles a segment, so the tables one after
      // another hold every piece in partition order, as LayerTotals adds them.
      // The layer kernels are the optimizer's own (kernels/layers.h).
      pieces_ = compress::LayerPieces(config_, layout_, {0, dim});
      std::vector<std::vector<compress::LayerPiece>> of(
          layout_.segment_count());
      uint32_t last = 0;
      for (const compress::Partition& p : layout_.partitions()) {
        MORSE_CHECK(p.segment >= last);
        last = p.segment;
        for (const compress::LayerPiece& piece :
             compress::LayerPiecesOf(config_, p.range)) {
          of[p.segment].push_back(piece);
        }
      }
      for (const std::vector<compress::LayerPiece>& pieces : of) {
        auto group = kernels::LayerKernelsFor(config_, pieces);
        if (!group.ok()) return group.status();
        layer_groups_.push_back(*std::move(group));
      }
    }
    // The encodes and their copies to the host at the device's highest
    // stream priority, ahead of backward()'s queued kernels (the 1-bit step
    // 5-11% shorter on an H200; docs/gpu.md); MORSE_SEND_STREAM_PRIORITY=
    // normal puts them at the default priority.
    const char* priority = std::getenv("MORSE_SEND_STREAM_PRIORITY");
    const bool normal =
        priority != nullptr && std::strcmp(priority, "normal") == 0;
    if (priority != nullptr && !normal && std::strcmp(priority, "high") != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("MORSE_SEND_STREAM_PRIORITY=", priority,
                       ": high (the default) or normal"));
    }
    if (normal) description_ += ", its send stream at normal priority";
    auto send = kernels::Context::Create(/*high_priority=*/!normal);
    if (!send.ok()) return send.status();
    send_ = *std::move(send);
    auto apply = kernels::Context::Create();
    if (!apply.ok()) return apply.status();
    apply_ = *std::move(apply);
    mlp_ops_ = std::make_unique<DeviceMlpOps>(*send_);
    return absl::OkStatus();
  }

  const std::string& kind() const override { return kName; }
  const std::string& description() const override { return description_; }
  DeviceServices* device() override { return this; }
  // Every partition: each has its own staging slot, and a partition that
  // waited for a slot of the window left late (the 134M model's last 24
  // partitions on an H200; docs/benchmarks.md, "A training step").
  uint32_t DefaultWindow(size_t partitions) const override {
    return static_cast<uint32_t>(std::max<size_t>(1, partitions));
  }

  absl::Status Load(const compress::Replica& replica,
                    const compress::ErrorFeedback& error) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const size_t bytes = 4 * config_.layout.dim;
    std::vector<float> e(config_.layout.dim);
    error.Read(0, absl::MakeSpan(e));
    if (absl::Status s =
            kernels::CopyToDevice(x_ptr_, replica.x().data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = m_.Upload(replica.m().data(), bytes); !s.ok())
      return s;
    if (absl::Status s = v_.Upload(replica.v().data(), bytes); !s.ok())
      return s;
    if (absl::Status s = e_.Upload(e.data(), bytes); !s.ok()) return s;
    if (absl::Status s =
            Upload(replica.SaveState(0, config_.layout.dim), state_);
        !s.ok())
      return s;
    std::vector<compress::NamedState> interval = replica.SaveInterval();
    has_interval_ = false;  // whether its per-element arrays hold one
    for (size_t i = 0; i < interval.size(); ++i) {
      if (interval_[i].array.per_element && !interval[i].values.empty())
        has_interval_ = true;
    }
    local_step_ = replica.last_local_step();
    return Upload(std::move(interval), interval_);
  }

  absl::Status Store(compress::Replica& replica,
                     compress::ErrorFeedback& error) override {
    if (absl::Status s = FinishApplies(); !s.ok()) return s;
    const size_t bytes = 4 * config_.layout.dim;
    std::vector<float> e(config_.layout.dim);
    if (absl::Status s = kernels::CopyToHost(replica.x().data(), x_ptr_, bytes);
        !s.ok())
      return s;
    if (absl::Status s = m_.Download(replica.mutable_m().data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = v_.Download(replica.mutable_v().data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = e_.Download(e.data(), bytes); !s.ok()) return s;
    absl::StatusOr<std::vector<compress::NamedState>> own = Download(state_);
    if (!own.ok()) return own.status();
    if (absl::Status s = replica.RestoreState(0, config_.layout.dim, *own);
        !s.ok())
      return s;
    if (!interval_.empty()) {
      absl::StatusOr<std::vector<compress::NamedState>> interval =
          Download(interval_);
      if (!interval.ok()) return interval.status();
      if (absl::Status s = replica.RestoreInterval(*interval, local_step_);
          !s.ok())
        return s;
    }
    return error.Restore(e);
  }

  absl::Status SetHostGradient(absl::Span<const float>) override {
    return absl::FailedPreconditionError(
        "this engine keeps the model on the GPU: its gradient is a device "
        "array "
        "(a workload's hook, or the one given at creation)");
  }

  absl::Status ReadGradient(absl::Span<float> grad) override {
    if (grad.size() != config_.layout.dim) {
      return absl::InvalidArgumentError("the gradient has dim floats");
    }
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    if (absl::Status s = send_->Synchronize(); !s.ok()) return s;
    return kernels::CopyToHost(grad.data(), grad_ptr_, 4 * grad.size());
  }

  absl::Status WaitFor(void* stream) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    return send_->WaitFor(stream);
  }

  absl::Status Encode(int64_t step, uint32_t rank, const compress::Partition& p,
                      std::string* payload, float grad_scale,
                      const compress::StepHyper* hyper) override {
    absl::StatusOr<PendingEncode> pending =
        StartEncode(step, rank, p, grad_scale, hyper);
    if (!pending.ok()) return pending.status();
    return (*pending)(payload);
  }

  // The encode, its flag and the payload's copy to the host enqueued on the
  // send stream, then an event; the returned function waits for the event.
  // The rule (hyper's beta1 included) is planned here, on the caller's
  // thread: nothing reads `hyper` later.
  absl::StatusOr<PendingEncode> StartEncode(
      int64_t step, uint32_t rank, const compress::Partition& p,
      float grad_scale, const compress::StepHyper* hyper) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const compress::SendRule rule = compress::PlanSend(
        config_, step, compress::Direction::kUp, rank, p.range.begin, hyper);
    const uint64_t begin = p.range.begin, n = p.range.size();
    const size_t bytes = compress::PayloadBytes(rule.codec, n);
    const float* input = grad_ptr_ + begin;
    if (rule.accumulated) {
      // zero_one_adam's sync: the message is the interval's update
      // (compress::Replica::SyncMessage), formed in scratch.
      if (local_step_ != step) {
        return absl::FailedPreconditionError(
            absl::StrCat("the sync of step ", step, " before its local step"));
      }
      // Each segment's elements with its own learning-rate sum.
      float* message = scratch_.as<float>() + begin;
      absl::Status s;
      compress::ForEachSegmentPart(
          config_.layout, p.range, [&](uint32_t k, compress::Range part) {
            if (!s.ok()) return;
            s = kernels::ZeroOneSyncMessage(
                *send_, rule.sync, HostState("lr_sum")[k],
                DeviceState("u") + part.begin, m_.as<float>() + part.begin,
                v_.as<float>() + part.begin, scratch_.as<float>() + part.begin,
                part.size());
          });
      if (!s.ok()) return s;
      input = message;
    } else if (grad_scale != 1.0f) {
      // The worker's own clip factor (compress::ClipsLocally): the local
      // momentum of k*g, k*g formed in scratch first as the CPU does.
      if (!rule.local_momentum) {
        return absl::FailedPreconditionError(
            "a worker scales its own gradient only in the compression phase");
      }
      float* scaled = scratch_.as<float>() + begin;
      if (absl::Status s = kernels::Scale(*send_, grad_scale, input, scaled, n);
          !s.ok())
        return s;
      input = scaled;
    }
    // The local momentum is formed inside the encode (fused for sign1).
    const float* momentum_m =
        rule.local_momentum ? m_.as<float>() + begin : nullptr;
    float* scratch = scratch_.as<float>() + begin;
    compress::FeedbackArgs fb;
    float* error = nullptr;
    if (rule.feedback &&
        config_.worker_feedback.kind != compress::FeedbackKind::kNone) {
      fb = {config_.worker_feedback.kind, config_.worker_feedback.beta};
      error = e_.as<float>() + begin;
    }
    // The zero-variance mask reads v where it lives (fused into sign1).
    const float* mask_v = rule.mask ? v_.as<float>() + begin : nullptr;
    Slot& slot = slots_[p.id];
    uint8_t* device_payload = payloads_.as<uint8_t>() + slot.offset;
    if (absl::Status s = kernels::EnqueueEncodeWithError(
            *send_, rule.codec, input, error, n, fb, rule.key, device_payload,
            flags_.as<int>() + p.id, host_flag(p.id), mask_v, momentum_m,
            rule.beta1, scratch);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = send_->CopyToHost(payloads_host_.data() + slot.offset,
                                           device_payload, bytes);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = slot.encoded.Record(*send_); !s.ok()) return s;
    return PendingEncode([this, id = p.id, bytes,
                          codec = rule.codec](std::string* payload) {
      if (absl::Status s = OnDevice(); !s.ok()) return s;
      const Slot& slot = slots_[id];
      if (absl::Status s = slot.encoded.Synchronize(); !s.ok()) return s;
      if (absl::Status s = kernels::EncodeFlagStatus(codec, *host_flag(id));
          !s.ok()) {
        return s;
      }
      payload->assign(
          reinterpret_cast<const char*>(payloads_host_.data() + slot.offset),
          bytes);
      return absl::OkStatus();
    });
  }

  // The shard's layer statistics (piece_stats) are left: the device sums
  // its own segments in CommitStep, the same bits.
  absl::Status ApplyReply(
      int64_t step, const compress::Partition& p,
      absl::Span<const uint8_t> reply, const compress::StepHyper* hyper,
      float grad_scale, absl::Span<const double> /*piece_stats*/,
      absl::Span<const compress::ClipPiece> clip_pieces) override {
    if (absl::Status s = StageReply(step, p, reply); !s.ok()) return s;
    return ApplyStagedReply(step, p, hyper, grad_scale, clip_pieces);
  }

  // The reply into the partition's own slot (its push has left: no other
  // reply or encode uses the slot until FinishApplies), then to the device
  // on the apply stream.
  absl::Status StageReply(int64_t step, const compress::Partition& p,
                          absl::Span<const uint8_t> reply) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const compress::CodecSpec codec = compress::PlanReply(config_, step).codec;
    if (absl::Status s =
            compress::ValidatePayload(codec, reply, p.range.size());
        !s.ok())
      return s;
    Slot& slot = slots_[p.id];
    uint8_t* host = payloads_host_.data() + slot.offset;
    std::copy(reply.begin(), reply.end(), host);
    MutexLock lock(&apply_mu_);
    slot.staged = reply.size();
    return apply_->CopyToDevice(payloads_.as<uint8_t>() + slot.offset, host,
                                reply.size());
  }

  absl::Status ApplyStagedReply(
      int64_t step, const compress::Partition& p,
      const compress::StepHyper* hyper, float grad_scale,
      absl::Span<const compress::ClipPiece> clip_pieces) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const compress::ReplyRule rule =
        compress::PlanReply(config_, step, hyper, grad_scale);
    const uint64_t begin = p.range.begin, n = p.range.size();
    Slot& slot = slots_[p.id];
    MutexLock lock(&apply_mu_);
    if (slot.staged != compress::PayloadBytes(rule.codec, n)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", p.id, " has no staged reply of step ", step));
    }
    slot.staged = 0;
    const uint8_t* payload = payloads_.as<uint8_t>() + slot.offset;
    if (rule.frozen_variance && !rule.lamb && rule.grad_scale == 1.0f &&
        clip_pieces.empty() && rule.codec.kind == compress::CodecKind::kSign1) {
      return kernels::DecodeFrozenUpdate(
          *apply_, rule.codec, payload, n, rule.scalars, rule.mask,
          x_ptr_ + begin, m_.as<float>() + begin, v_.as<float>() + begin);
    }
    // compress::ApplyRule's cases, on the decoded reply.
    float* decoded = apply_scratch_.as<float>() + begin;
    absl::Status s = kernels::Decode(*apply_, rule.codec, payload, n, decoded);
    if (s.ok() &&
        rule.grad_scale != 1.0f) {  // the averaged gradient's clip factor
      s = kernels::Scale(*apply_, rule.grad_scale, decoded, decoded, n);
    }
    // A clip of part of the model: each piece by its own factor (the
    // same multiplication as compress::ScaleByPieces).
    uint64_t start = 0;
    for (const compress::ClipPiece& piece : clip_pieces) {
      if (s.ok() && piece.scale != 1.0f) {
        s = kernels::Scale(*apply_, piece.scale, decoded + start,
                           decoded + start, piece.end - start);
      }
      start = piece.end;
    }
    if (!s.ok()) return s;
    return UpdateFromDecoded(rule, begin, n);  // enqueued; FinishApplies waits
  }

  // The amended gradient in place of the partition's reply, decoded and
  // clipped (compress::Replica::ApplyReply's `amended`: the rule's codec
  // fp32, scaled by nothing), into the decode's scratch and then through
  // the same update.
  absl::Status ApplyAmended(int64_t step, const compress::Partition& p,
                            absl::Span<const float> gradient,
                            const compress::StepHyper* hyper) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const uint64_t begin = p.range.begin, n = p.range.size();
    if (gradient.size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("an amended gradient of ", gradient.size(),
                       " floats for partition ", p.id, " of ", n));
    }
    compress::ReplyRule rule = compress::PlanReply(config_, step, hyper, 1.0f);
    rule.codec = compress::CodecSpec{compress::CodecKind::kFp32};
    MutexLock lock(&apply_mu_);
    slots_[p.id].staged = 0;  // the partition's reply, if staged, is not used
    if (absl::Status s = apply_->CopyToDevice(
            apply_scratch_.as<float>() + begin, gradient.data(), 4 * n);
        !s.ok())
      return s;
    return UpdateFromDecoded(rule, begin, n);
  }

  absl::StatusOr<absl::Span<const uint8_t>> StagedReply(
      const compress::Partition& p) const override {
    MutexLock lock(&apply_mu_);
    const Slot& slot = slots_[p.id];
    if (slot.staged == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", p.id, " has no staged reply"));
    }
    return absl::Span<const uint8_t>(payloads_host_.data() + slot.offset,
                                     slot.staged);
  }

  absl::Status FinishApplies() override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    return apply_->Synchronize();
  }

  absl::StatusOr<double> GradientSumOfSquares() override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    return kernels::SumOfSquares(
        *send_, grad_ptr_, config_.layout.dim, square_sums_.as<double>(),
        reinterpret_cast<double*>(square_sums_host_.data()));
  }

  // compress::Replica::LocalStep on the device: the anchor, the
  // accumulated update u and each segment's learning-rate sum live here;
  // each segment's elements step with its own lr and weight_decay
  // (parameter groups).
  absl::StatusOr<std::vector<float>> LocalStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      float grad_scale, compress::ComputePool*) override {
    if (absl::Status s =
            compress::CheckHyperCount(hypers, layout_.segment_count());
        !s.ok())
      return s;
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const absl::StatusOr<bool> starts =
        compress::BeginLocalStep(config_, step, local_step_);
    if (!starts.ok()) return starts.status();
    const size_t bytes = 4 * config_.layout.dim;
    std::vector<float>& lr_sums = HostState("lr_sum");  // one per segment
    if (*starts) {
      // x is final: every reply's update was synchronized. Both ahead of
      // the step's kernel on the same stream.
      if (absl::Status s = send_->Copy(DeviceState("anchor"), x_ptr_, bytes);
          !s.ok())
        return s;
      if (absl::Status s = send_->Fill(DeviceState("u"), 0, bytes); !s.ok())
        return s;
      has_interval_ = true;
      std::fill(lr_sums.begin(), lr_sums.end(), 0.0f);
    }
    std::vector<compress::AdamScalars> scalars;
    for (uint32_t k = 0; k < lr_sums.size(); ++k) {
      scalars.push_back(compress::LocalStepScalars(
          config_, step, compress::HyperOf(hypers, k)));
    }
    const bool exchanges = compress::PlanStep(config_, step).exchanges;
    const float* g = grad_ptr_;
    if (grad_scale != 1.0f) {  // the worker's own clip factor
      if (absl::Status s = kernels::Scale(
              *send_, grad_scale, g, scratch_.as<float>(), config_.layout.dim);
          !s.ok()) {
        return s;
      }
      g = scratch_.as<float>();
    }
    absl::Status s;
    compress::ForEachSegmentPart(
        config_.layout, compress::Range{0, config_.layout.dim},
        [&](uint32_t k, compress::Range part) {
          if (!s.ok()) return;
          const uint64_t at = part.begin;
          s = kernels::ZeroOneLocalStep(
              *send_, scalars[k], g + at, x_ptr_ + at, m_.as<float>() + at,
              DeviceState("u") + at, v_.as<float>() + at, part.size(),
              /*write_x=*/!exchanges);
        });
    if (!s.ok()) return s;
    // Store and the next gradient read x and m from other streams.
    if (absl::Status s = send_->Synchronize(); !s.ok()) return s;
    for (uint32_t k = 0; k < lr_sums.size(); ++k) lr_sums[k] += scalars[k].lr;
    local_step_ = step;
    return lr_sums;
  }

  // compress::Replica::CommitStep on the device: the segments' sums come to
  // the host, which forms the totals and the commit exactly as the CPU does.
  // Each parameter group's layers with its own rule (lr and weight_decay).
  absl::StatusOr<std::vector<double>> CommitStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      compress::ComputePool*) override {
    const compress::LayerRule* layers = compress::OptimizerOf(config_).Layers();
    if (layers == nullptr) {
      return absl::FailedPreconditionError(
          "CommitStep is for an optimizer with a layer rule");
    }
    if (absl::Status s =
            compress::CheckHyperCount(hypers, layout_.segment_count());
        !s.ok())
      return s;
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    const std::vector<compress::ReplyRule> rules =
        compress::PlanReplies(config_, step, hypers);
    MutexLock lock(&apply_mu_);
    // The groups' pieces one after another: every piece's statistics in
    // partition order.
    std::vector<double> piece_stats;
    for (uint32_t k = 0; k < layer_groups_.size(); ++k) {
      absl::StatusOr<absl::Span<const double>> of =
          layer_groups_[k]->PieceStats(
              *apply_, compress::RuleOf(rules, k), x_ptr_, m_.as<float>(),
              v_.as<float>(),
              LayerArray(/*per_element=*/true).device.as<float>());
      if (!of.ok()) return of.status();
      piece_stats.insert(piece_stats.end(), of->begin(), of->end());
    }
    const std::vector<double> totals =
        compress::LayerTotals(config_, *layers, pieces_, piece_stats);
    std::vector<double> commit =
        compress::LayerCommit(config_, *layers, rules, totals,
                              LayerArray(/*per_element=*/false).host);
    if (absl::Status s =
            compress::ValidateCommitOfLayers(config_, *layers, commit);
        !s.ok())
      return s;
    for (uint32_t k = 0; k < layer_groups_.size(); ++k) {
      if (absl::Status s = layer_groups_[k]->MoveX(
              *apply_, compress::RuleOf(rules, k), commit, x_ptr_,
              m_.as<float>(), v_.as<float>());
          !s.ok()) {
        return s;
      }
    }
    // The arrays that are not per element, as the commit leaves them.
    std::vector<std::vector<float>> after =
        compress::OptimizerOf(config_).StateAfterCommit(config_, commit);
    size_t next = 0;
    for (OwnState& own : state_) {
      if (!own.array.per_element) own.host = std::move(after[next++]);
    }
    return commit;
  }

  // DeviceServices: what workloads' hooks use, on the send stream (ahead of
  // the encodes that read their gradient).
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    auto buffer = kernels::DeviceBuffer::Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    workload_buffers_.push_back(*std::move(buffer));
    return workload_buffers_.back().data();
  }
  absl::Status CopyIn(void* device, const void* host, size_t bytes) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    // Pageable host memory: the copy is staged before this returns.
    return send_->CopyToDevice(device, host, bytes);
  }
  MlpOps& mlp_ops() override { return *mlp_ops_; }
  absl::StatusOr<double> SyntheticGradient(uint64_t seed, int64_t step,
                                           uint32_t rank, float noise,
                                           uint32_t dead_every, const float* a,
                                           const float* t, const float* x,
                                           float* grad, size_t n) override {
    if (absl::Status s = OnDevice(); !s.ok()) return s;
    return kernels::SyntheticGradient(*send_, seed, step, rank, noise, a, t, x,
                                      grad, n, dead_every);
  }

 protected:
  float* x() override { return x_ptr_; }
  float* grad() override { return grad_ptr_; }
  uint64_t x_dim() const override { return config_.layout.dim; }

 private:
  // Every entry point runs on the device the engine was created on,
  // whatever the calling thread (gRPC threads apply replies).
  absl::Status OnDevice() const { return kernels::SetDevice(device_); }

  // compress::ApplyRule's update of elements [begin, begin + n) from the
  // decoded, clipped values in apply_scratch_ there, enqueued on the apply
  // stream (apply_mu_ held).
  absl::Status UpdateFromDecoded(const compress::ReplyRule& rule,
                                 uint64_t begin, uint64_t n) {
    const float* decoded = apply_scratch_.as<float>() + begin;
    float* x = x_ptr_ + begin;
    float* m = m_.as<float>() + begin;
    float* v = v_.as<float>() + begin;
    if (rule.lamb) {
      compress::ReplyRule moments = rule;
      moments.grad_scale = 1.0f;  // the decoded values are scaled already
      return kernels::LambMoments(*apply_, moments, decoded, m, v,
                                  DeviceState("v_fresh") + begin, n);
    }
    if (rule.sync) {
      const float* anchor = has_interval_ ? DeviceState("anchor") + begin : x;
      return kernels::ZeroOneSyncUpdate(*apply_, rule.scalars, rule.mask,
                                        decoded, anchor, x, m, v, n);
    }
    if (rule.frozen_variance) {
      return kernels::FrozenUpdate(*apply_, rule.scalars, rule.mask, decoded, x,
                                   m, v, n);
    }
    if (rule.bounded_variance) {
      return kernels::ZeroOneVarianceUpdate(*apply_, rule.scalars, decoded, x,
                                            m, v, n);
    }
    return kernels::AdamUpdate(*apply_, rule.scalars, decoded, x, m, v, n);
  }

  static inline const std::string kName = "cuda";
  compress::AlgorithmConfig config_;
  compress::Layout layout_;
  std::string description_;
  DeviceArrays arrays_;
  int device_ = 0;
  kernels::DeviceBuffer x_, m_, v_, e_, grad_, scratch_, apply_scratch_;
  // The optimizer's own arrays (compress::Optimizer::State, in its order)
  // and those of its local interval (IntervalState: zero_one_adam's anchor,
  // u and lr sums): a per-element one on the device, the others on the host.
  struct OwnState {
    compress::StateArray array;
    kernels::DeviceBuffer device;
    std::vector<float> host;
  };
  std::vector<OwnState> state_, interval_;
  bool has_interval_ = false;  // interval_'s per-element arrays hold one
  int64_t local_step_ = -1;    // the last step LocalStep ran
  // The array the optimizer names `name` (its kernels' operand).
  OwnState& Own(absl::string_view name) {
    for (std::vector<OwnState>* arrays : {&state_, &interval_}) {
      for (OwnState& own : *arrays) {
        if (own.array.name == name) return own;
      }
    }
    MORSE_CHECK(false);
    return state_.front();
  }
  float* DeviceState(absl::string_view name) {
    return Own(name).device.as<float>();
  }
  std::vector<float>& HostState(absl::string_view name) {
    return Own(name).host;
  }
  // A layer rule's arrays (compress/layers.h): its state's per-element one
  // (the rule's `fresh`) and its layer state, in that order.
  OwnState& LayerArray(bool per_element) {
    for (OwnState& own : state_) {
      if (own.array.per_element == per_element) return own;
    }
    MORSE_CHECK(false);
    return state_.front();
  }
  // A replica's arrays (SaveState's or SaveInterval's form, in `owned`'s
  // order) into the engine's: a per-element one left empty stays as it is.
  absl::Status Upload(std::vector<compress::NamedState> saved,
                      std::vector<OwnState>& owned) {
    MORSE_CHECK(saved.size() == owned.size());
    for (size_t i = 0; i < owned.size(); ++i) {
      if (!owned[i].array.per_element) {
        owned[i].host = std::move(saved[i].values);
      } else if (!saved[i].values.empty()) {
        if (absl::Status s = owned[i].device.Upload(saved[i].values.data(),
                                                    4 * saved[i].values.size());
            !s.ok())
          return s;
      }
    }
    return absl::OkStatus();
  }
  // The engine's arrays in a replica's form; the interval's per-element
  // ones empty where no interval is under way.
  absl::StatusOr<std::vector<compress::NamedState>> Download(
      const std::vector<OwnState>& owned) const {
    const bool held = &owned != &interval_ || has_interval_;
    std::vector<compress::NamedState> out(owned.size());
    for (size_t i = 0; i < owned.size(); ++i) {
      out[i].name = owned[i].array.name;
      if (!owned[i].array.per_element) {
        out[i].values = owned[i].host;
      } else if (held) {
        out[i].values.resize(config_.layout.dim);
        if (absl::Status s = owned[i].device.Download(out[i].values.data(),
                                                      4 * config_.layout.dim);
            !s.ok())
          return s;
      }
    }
    return out;
  }
  // An optimizer with a layer rule: the pieces of compress::LayerTotals in
  // partition order, and its layer kernels over each parameter group
  // (segment of the layout).
  std::vector<compress::LayerPiece> pieces_;
  std::vector<std::unique_ptr<kernels::LayerKernels>> layer_groups_;
  float* x_ptr_ = nullptr;     // x_ or the caller's
  float* grad_ptr_ = nullptr;  // grad_ or the caller's
  // A partition's staging: its bytes at `offset` in payloads_ and
  // payloads_host_, its flag at its index in flags_ and flags_host_, and
  // the event after its encode's copy to the host.
  struct Slot {
    size_t offset;
    kernels::Event encoded;
    size_t staged = 0;  // bytes of a staged reply (apply_mu_)
  };
  int* host_flag(uint32_t id) const {
    return reinterpret_cast<int*>(flags_host_.data()) + id;
  }
  std::vector<Slot> slots_;
  kernels::DeviceBuffer payloads_, flags_;
  kernels::PinnedBuffer payloads_host_, flags_host_;
  // clip_grad_norm: the gradient's segment sums of squares.
  kernels::DeviceBuffer square_sums_;
  kernels::PinnedBuffer square_sums_host_;
  std::unique_ptr<kernels::Context> send_, apply_;
  mutable Mutex apply_mu_;
  std::unique_ptr<DeviceMlpOps> mlp_ops_;
  std::list<kernels::DeviceBuffer> workload_buffers_;
};

}  // namespace

absl::StatusOr<std::string> Describe() { return kernels::DeviceDescription(); }

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const EngineState& state,
                                                     DeviceArrays arrays) {
  auto device = Describe();
  if (!device.ok()) return device.status();
  const compress::AlgorithmConfig& config = *state.config;
  if (config.worker_feedback.storage != compress::ErrorStorage::kFp32) {
    return absl::UnimplementedError(
        "the GPU path keeps the error buffer in fp32 (worker_feedback storage "
        "int8)");
  }
  for (const compress::CodecSpec* spec :
       {&config.warmup_codec, &config.up_codec, &config.down_codec}) {
    if (!OnGpu(spec->kind)) {
      return absl::UnimplementedError(
          absl::StrCat(compress::CodecName(spec->kind), " has no GPU kernel"));
    }
  }
  const compress::Optimizer& optimizer = compress::OptimizerOf(config);
  if (!optimizer.HasGpuKernels()) {
    return absl::UnimplementedError(absl::StrCat(
        optimizer.name(), " has no GPU kernels; it trains on the CPU"));
  }
  if (optimizer.Layers() != nullptr && !kernels::HasLayerKernels(config)) {
    return absl::UnimplementedError(
        absl::StrCat(optimizer.name(),
                     " has no GPU kernels for its layer rule; it trains on "
                     "the CPU"));
  }
  const bool freezes = optimizer.FreezesVariance();
  if (freezes && config.mask_zero_variance &&
      config.up_codec.kind != compress::CodecKind::kSign1) {
    return absl::UnimplementedError(absl::StrCat(
        "the zero-variance mask is fused into sign1 only on the GPU; up_codec ",
        compress::CodecName(config.up_codec.kind),
        " with mask_zero_variance trains on the CPU"));
  }
  if (!freezes && config.up_codec.kind == compress::CodecKind::kFp32 &&
      config.worker_feedback.kind != compress::FeedbackKind::kNone) {
    return absl::UnimplementedError(
        "fp32 with error feedback has no GPU kernel");
  }
  auto engine = std::make_unique<CudaEngine>(state, *device, arrays);
  if (absl::Status s = engine->Init(); !s.ok()) return s;
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace morse::worker::cuda
