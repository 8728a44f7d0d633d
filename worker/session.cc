#include "worker/session.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "compress/codec.h"
#include "compress/optimizer.h"
#include "compress/trace.h"
#include "proto/checkpoint_file.h"
#include "worker/engine/host/engine.h"
#include "worker/rpc_status.h"
#include "worker/shard_recovery.h"
#include "worker/transport/grpc/transport.h"

namespace morse::worker {
namespace {

// Threads that wait for a device engine's encodes (and apply replies) when
// the session was made without a compute pool (morse.torch's ranks).
constexpr int kDeviceCompletionThreads = 4;

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Connect(
    const proto::JobSpec& job, uint32_t rank, std::vector<std::string> servers,
    const proto::SecurityOptions& security, absl::Span<float> x,
    int compute_threads) {
  auto transport =
      GrpcTransport::Create(job, std::move(servers), rank, security);
  if (!transport.ok()) return transport.status();
  return Connect(job, rank, *std::move(transport), x, compute_threads,
                 !security.insecure);
}

absl::StatusOr<std::unique_ptr<Session>> Session::Connect(
    const proto::JobSpec& job, uint32_t rank,
    std::unique_ptr<Transport> transport, absl::Span<float> x,
    int compute_threads, bool tls) {
  auto layout = compress::Layout::Create(job.algorithm.layout);
  if (!layout.ok()) return layout.status();
  if (!x.empty() && x.size() != job.algorithm.layout.dim) {
    return absl::InvalidArgumentError(absl::StrCat("parameters of ", x.size(),
                                                   " elements for a job of ",
                                                   job.algorithm.layout.dim));
  }
  if (absl::Status s = proto::CheckFitsInMemory(
          proto::WorkerStateBytes(job),
          absl::StrCat("worker ", rank, " (", job.algorithm.layout.dim,
                       " elements)"));
      !s.ok()) {
    return s;
  }
  if (compute_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compute threads: ", compute_threads, "; at least 0 (0: none)"));
  }
  auto client =
      PushClient::Create(job, *layout, std::move(transport), rank, tls);
  if (!client.ok()) return client.status();
  std::unique_ptr<Session> session(
      new Session(job, rank, *std::move(layout), x));
  session->client_ = *std::move(client);
  if (compute_threads > 0)
    session->pool_ = std::make_unique<compress::ComputePool>(compute_threads);
  if (absl::Status s = session->client_->WaitForShards(); !s.ok()) return s;
  if (absl::Status s = session->client_->Join(); !s.ok()) return s;
  return session;
}

Session::~Session() { exchange_.reset(); }

Session::Session(const proto::JobSpec& job, uint32_t rank,
                 compress::Layout layout, absl::Span<float> x)
    : job_(job),
      rank_(rank),
      layout_(std::move(layout)),
      replica_(x.empty() ? compress::Replica(job.algorithm,
                                             {0, job.algorithm.layout.dim})
                         : compress::Replica(job.algorithm,
                                             {0, job.algorithm.layout.dim}, x)),
      error_(job.algorithm.worker_feedback, job.algorithm.layout.dim,
             job.algorithm.layout.block_elems),
      engine_(host::CreateEngine(
          EngineState{&job_.algorithm, &layout_, &replica_, &error_})) {}

absl::StatusOr<bool> Session::ShardsHoldModel() {
  auto infos = client_->ShardInfos();
  if (!infos.ok()) return infos.status();
  for (const v1::ShardInfo& info : *infos) {
    if (!info.initialized()) return false;
  }
  return true;
}

absl::StatusOr<int64_t> Session::Start(bool resume,
                                       const std::string& checkpoint) {
  if (!resume) {
    if (rank_ == 0) {
      if (absl::Status s = client_->UploadInitialParameters(replica_.x());
          !s.ok())
        return s;
    }
    if (absl::Status s = client_->WaitInitialized(); !s.ok()) return s;
    if (rank_ != 0) {
      // Rank 0 may already be restoring a saved run (load_state_dict)
      // partition by partition.
      absl::StatusOr<int64_t> step = FetchSteadyModel();
      if (!step.ok()) return step.status();
      step_ = *step;
    }
    return step_;
  }
  if (absl::Status s = client_->WaitInitialized(); !s.ok()) return s;
  std::optional<proto::CheckpointReader> reader;
  if (!checkpoint.empty()) {
    auto opened = proto::CheckpointReader::Open(checkpoint);
    if (!opened.ok() && opened.status().code() != absl::StatusCode::kNotFound)
      return opened.status();
    if (opened.ok() &&
        opened->header().layout_fingerprint == layout_.fingerprint() &&
        opened->header().algorithm_fingerprint ==
            compress::AlgorithmFingerprint(job_.algorithm)) {
      reader = *std::move(opened);
    }
  }
  if (reader.has_value()) {
    // A checkpoint of this worker's whole state at a step the shards have
    // reached: start there. Steps the shards have completed since are
    // replayed: they answer each push with the reply it had then (checked
    // against the push's hash), so this worker ends where an undisturbed one
    // would (DESIGN 4).
    // (Inside a zero_one_adam local interval the state is of a later step
    // than the header's, with no exchange between them.)
    auto infos = client_->ShardInfos();
    if (!infos.ok()) return infos.status();
    int64_t completed = INT64_MAX, kept_from = 0;
    for (const v1::ShardInfo& info : *infos) {
      completed = std::min(completed, info.completed_steps());
      kept_from = std::max(kept_from, info.replies_kept_from());
    }
    // The step the whole state is of (-1: a checkpoint of the error buffer
    // alone), which the shards must still hold every reply after.
    int64_t whole_step = -1;
    if (reader->Has("whole_step")) {
      auto stored = reader->Ints("whole_step", 1);
      if (!stored.ok()) return stored.status();
      whole_step = (*stored)[0];
    }
    if (whole_step >= 0 && reader->header().step <= completed &&
        whole_step >= std::min(kept_from, completed)) {
      if (absl::Status s = RestoreWholeState(*reader, whole_step); !s.ok())
        return s;
      step_ = whole_step;
      if (step_ >= completed) {
        std::printf(
            "worker %u: resuming at step %lld; model and error buffer from "
            "%s\n",
            rank_, static_cast<long long>(step_), checkpoint.c_str());
      } else {
        std::printf(
            "worker %u: rejoining at step %lld from %s (model and error "
            "buffer); the shards "
            "have completed %lld steps: replaying steps %lld..%lld with the "
            "replies they kept\n",
            rank_, static_cast<long long>(step_), checkpoint.c_str(),
            static_cast<long long>(completed), static_cast<long long>(step_),
            static_cast<long long>(completed - 1));
      }
      return step_;
    }
  }
  // A running job's partitions may be a step apart (an elastic job goes
  // on while this worker joins).
  absl::StatusOr<int64_t> step = FetchSteadyModel();
  if (!step.ok()) return step.status();
  step_ = *step;
  // At step 0 the error buffer is zero in every run: nothing is lost.
  std::string restored = step_ == 0 ? "zero (the job's first step)"
                                    : "from zero (no checkpoint of this step)";
  if (reader.has_value() && step_ > 0) {
    if (reader->header().step == step_) {
      auto error = reader->Floats("worker_error", job_.algorithm.layout.dim);
      if (!error.ok()) return error.status();
      if (absl::Status s = error_.Restore(*error); !s.ok()) return s;
      restored = "from " + checkpoint;
    } else {
      restored = absl::StrCat(
          "from zero (", checkpoint, " is of step ", reader->header().step,
          ", and the shards keep no replies to replay from there)");
    }
  }
  std::printf(
      "worker %u: resuming at step %lld; model from the shards, error buffer "
      "%s\n",
      rank_, static_cast<long long>(step_), restored.c_str());
  return step_;
}

absl::StatusOr<int64_t> Session::FetchSteadyModel() {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  absl::StatusOr<int64_t> step = client_->FetchModel(replica_);
  while (!step.ok() &&
         step.status().GetPayload(PushClient::kMixedStepsKey).has_value() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    step = client_->FetchModel(replica_);
  }
  return step;
}

absl::Status Session::Begin(absl::Span<const float> grad) {
  if (InStep())
    return absl::FailedPreconditionError("a step is already in progress");
  if (absl::Status s = engine_->SetHostGradient(grad); !s.ok()) return s;
  return BeginStep();
}

absl::Status Session::BeginFromEngine() { return BeginStep(); }

absl::Status Session::SetStepHyper(std::vector<compress::StepHyper> hypers) {
  if (absl::Status s =
          compress::CheckHyperCount(hypers, layout_.segment_count());
      !s.ok()) {
    return s;
  }
  for (const compress::StepHyper& hyper : hypers) {
    if (absl::Status s = compress::CheckStepHyper(job_.algorithm, hyper);
        !s.ok()) {
      return s;
    }
  }
  hyper_ = std::move(hypers);
  return absl::OkStatus();
}

absl::Status Session::StepFromEngine(StepTraffic* traffic) {
  if (absl::Status s = BeginFromEngine(); !s.ok()) return s;
  return Finish(traffic);
}

absl::Status Session::MoveTo(const std::string& kind, DeviceArrays arrays) {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  if (absl::Status s = SyncHost(); !s.ok()) return s;
  auto engine = CreateEngine(
      kind, EngineState{&job_.algorithm, &layout_, &replica_, &error_}, arrays);
  if (!engine.ok()) return engine.status();
  if (absl::Status s = (*engine)->Load(replica_, error_); !s.ok()) return s;
  engine_ = *std::move(engine);
  // A device engine's encodes finish on the compute pool (StartEncode), so
  // the thread that queues the gradient's work never waits for the device.
  if (engine_->kind() != "cpu" && pool_ == nullptr)
    pool_ = std::make_unique<compress::ComputePool>(kDeviceCompletionThreads);
  return absl::OkStatus();
}

absl::Status Session::SyncHost() { return engine_->Store(replica_, error_); }

absl::Status Session::BeginStep() {
  if (!failed_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_, " failed earlier (", failed_.message(),
        "); this worker's model may be half-updated: restart it with --resume "
        "(morse-worker) or rebuild the optimizer"));
  }
  if (InStep())
    return absl::FailedPreconditionError("a step is already in progress");
  for (const compress::StepHyper& hyper : hyper_) {
    if (absl::Status s = compress::CheckHyperAtStep(hyper, step_); !s.ok())
      return s;
  }
  trace_step_start_ = trace::Enabled() ? trace::NowMicros() : -1;
  plan_ = compress::PlanStep(job_.algorithm, step_);
  sent_.assign(layout_.partitions().size(), false);
  step_hyper_ = hyper_;
  // The workers' own max_norm (SetStepClipping): the average's clip in a
  // step that has one, each worker's own gradient's in a compressing step
  // (as clip_grad_norm does).
  workers_clip_ = clip_at_step_;
  max_norm_ = job_.algorithm.clip_grad_norm;
  clipped_ = false;
  clip_pieces_.clear();
  amended_.clear();
  own_sum_of_squares_.reset();
  waited_.reset();
  waited_traffic_ = StepTraffic{};
  clips_average_ = compress::ClipsAverage(job_.algorithm, step_) ||
                   (workers_clip_ && !plan_.compressing);
  clips_locally_ = compress::ClipsLocally(job_.algorithm, step_) ||
                   (workers_clip_ && plan_.compressing);
  local_scale_.reset();
  deferred_.reset();
  // zero_one_adam's local phase: a local step that does not sync, or whose
  // worker clips its own gradient, needs the whole gradient, so Finish does
  // it, and then sends if the step syncs.
  local_pending_ = plan_.local;
  if (local_pending_ && plan_.exchanges && !clips_locally_) {
    // A sync without the worker's own clipping: each partition's encode
    // runs its part of the local step (as 1-bit Adam's momentum), so the
    // pushes need not wait for the whole gradient. Where the engine cannot,
    // or the step cannot start here, Finish does it whole as below.
    const absl::StatusOr<std::vector<float>> lr_sums =
        engine_->BeginSyncLocalStep(step_, step_hyper_);
    if (lr_sums.ok()) {
      local_pending_ = false;
      SetSyncLr(*lr_sums);
    }
  }
  if (!local_pending_) StartExchange();
  return absl::OkStatus();
}

void Session::StartExchange() {
  const int64_t step = step_;
  engine_->BeginReplies(step);
  if (defer_apply_ || clips_average_) {
    deferred_ = std::make_shared<std::vector<std::optional<DeferredReply>>>(
        layout_.partitions().size());
  }
  exchange_ = std::make_unique<StepExchange>(
      client_.get(), pool_.get(), step, plan_.up.kind,
      client_->job().window != 0
          ? client_->job().window
          : engine_->DefaultWindow(layout_.partitions().size()),
      // The step keeps its own copy of the hyper-parameters it was begun with.
      [this, step, hyper = step_hyper_, deferred = deferred_](
          const compress::Partition& p, const std::string& reply,
          ReplyExtras extras) {
        const absl::Span<const uint8_t> bytes(
            reinterpret_cast<const uint8_t*>(reply.data()), reply.size());
        if (deferred !=
            nullptr) {  // each partition's slot is written by one reply only
          // A GPU engine takes the bytes to the device now, off the step's
          // end; the host keeps them here.
          trace::Scope traced("receive", step, p.id);
          const absl::Status staged = engine_->StageReply(step, p, bytes);
          if (!staged.ok() && !absl::IsUnimplemented(staged)) return staged;
          (*deferred)[p.id] = DeferredReply{staged.ok() ? std::string() : reply,
                                            std::move(extras), staged.ok()};
          return absl::OkStatus();
        }
        trace::Instant("receive", step, p.id);
        trace::Scope traced("apply", step, p.id);
        return engine_->ApplyReply(step, p, bytes, HyperOf(hyper, p), 1.0f,
                                   extras.piece_stats);
      },
      StepExtras{step_hyper_, std::move(buffers_),
                 previous_grad_sum_of_squares_, previous_clip_max_norm_,
                 previous_clip_pieces_, previous_commit_,
                 workers_clip_ && clips_average_,
                 step == 0 || step == x_hash_step_
                     ? (shown_x_.empty() ? absl::Span<const float>(replica_.x())
                                         : absl::MakeConstSpan(shown_x_))
                     : absl::Span<const float>(),
                 previous_amended_},
      /*parallel_encode=*/true);
  buffers_.clear();
}

absl::Status Session::LocalStep() {
  trace::Scope traced("local step", step_);
  local_pending_ = false;
  float scale = 1.0f;
  if (clips_locally_) {
    absl::StatusOr<float> own = OwnClipScale();
    if (!own.ok()) return own.status();
    scale = *own;
  }
  const absl::StatusOr<std::vector<float>> lr_sums =
      engine_->LocalStep(step_, step_hyper_, scale, pool_.get());
  if (!lr_sums.ok()) return lr_sums.status();
  // A sync's message is the interval's update, not the gradient.
  clips_locally_ = false;
  local_scale_ = 1.0f;
  if (!plan_.exchanges) return absl::OkStatus();
  SetSyncLr(*lr_sums);
  StartExchange();
  return absl::OkStatus();
}

void Session::SetSyncLr(absl::Span<const float> lr_sums) {
  // Every replica needs the interval's learning-rate sums for the sync; the
  // pushes carry each segment's as their lr when the workers set the lr
  // (compress::PlanReply).
  for (size_t k = 0; k < step_hyper_.size(); ++k)
    step_hyper_[k].lr = lr_sums[k];
}

absl::Status Session::SendPartition(uint32_t partition) {
  if (!InStep())
    return absl::FailedPreconditionError("no step in progress (call Begin)");
  if (partition >= sent_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("no partition ", partition));
  }
  if (sent_[partition] || local_pending_)
    return absl::OkStatus();  // a local step: Finish sends
  // Clipping this worker's own gradient needs all of it: Finish sends.
  if (clips_locally_ && !local_scale_.has_value()) return absl::OkStatus();
  sent_[partition] = true;
  const compress::Partition& p = layout_.partitions()[partition];
  trace::Instant("ready", step_, partition);  // its gradient is complete
  // A GPU engine enqueues the encode here, behind the gradient's work, and
  // the exchange waits for it on the compute pool; the host engine encodes
  // there.
  absl::StatusOr<Engine::PendingEncode> pending = engine_->StartEncode(
      step_, rank_, p, local_scale_.value_or(1.0f), HyperOf(step_hyper_, p));
  if (!pending.ok()) return Fail(pending.status());
  absl::Status sent = exchange_->Send(
      p, [pending = *std::move(pending), step = step_](
             const compress::Partition& p, std::string* payload) {
        // On a GPU: the wait for the device's encode and copy to the host.
        trace::Scope traced("encode", step, p.id);
        return pending(payload);
      });
  if (!sent.ok()) return Fail(sent);
  return absl::OkStatus();
}

absl::Status Session::SetStepClipping(bool on) {
  if (on && job_.algorithm.clip_grad_norm > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job clips every step by its clip_grad_norm ",
        job_.algorithm.clip_grad_norm, "; the workers cannot choose another"));
  }
  clip_at_step_ = on;
  return absl::OkStatus();
}

absl::StatusOr<double> Session::ClipAt(float max_norm) {
  if (!InStep())
    return absl::FailedPreconditionError("no step in progress (call Begin)");
  if (!failed_.ok()) return failed_;
  if (!workers_clip_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_,
                     " began without the workers' clipping (SetStepClipping)"));
  }
  if (!(std::isfinite(max_norm) && max_norm >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_norm ", max_norm, ": finite and not negative (0: no clip)"));
  }
  // Another call replaces the max_norm (and any clip pieces): nothing has
  // used them before Finish.
  clipped_ = true;
  max_norm_ = max_norm;
  clip_pieces_.clear();
  amended_.clear();
  if (clips_locally_) {
    // This worker's own gradient (a compressing step): its pushes wait for
    // Finish, which clips by the last max_norm (SendAndWait, LocalStep).
    absl::StatusOr<double> sum_of_squares = OwnSumOfSquares();
    if (!sum_of_squares.ok()) return Fail(sum_of_squares.status());
    return *sum_of_squares;
  }
  // The averaged gradient: every reply's norm.
  if (absl::Status s = SendAndWait(); !s.ok()) return s;
  absl::StatusOr<std::optional<double>> sum = RepliesSumOfSquares();
  if (!sum.ok()) return Fail(sum.status());
  return sum->value_or(0.0);
}

absl::Status Session::ClipPiecesAt(compress::ClipPieces pieces) {
  if (absl::Status s = HoldsAverage(); !s.ok()) return s;
  if (absl::Status s =
          compress::ValidateClipPieces(pieces, job_.algorithm.layout.dim);
      !s.ok()) {
    return s;
  }
  max_norm_ = 0.0f;
  clip_pieces_ = std::move(pieces);
  amended_.clear();
  return absl::OkStatus();
}

absl::Status Session::AmendAt(std::vector<float> gradient) {
  if (absl::Status s = HoldsAverage(); !s.ok()) return s;
  const uint64_t dim = job_.algorithm.layout.dim;
  if (gradient.size() != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("an amended gradient of ", gradient.size(), " floats for ",
                     dim, " parameters"));
  }
  for (uint64_t i = 0; i < dim; ++i) {
    if (!std::isfinite(gradient[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step_, ": the amended gradient's element ", i,
                       " is ", gradient[i]));
    }
  }
  // The amended gradient is the step's, clip and all: the commit carries
  // the sum of squares with a max_norm of 0 (the shards' mirrors scale it
  // by nothing).
  max_norm_ = 0.0f;
  clip_pieces_.clear();
  amended_ = std::move(gradient);
  return absl::OkStatus();
}

absl::Status Session::ClippedAverage(absl::Span<float> out) const {
  if (absl::Status s = AverageGradient(out); !s.ok()) return s;
  if (!amended_.empty()) {
    std::copy(amended_.begin(), amended_.end(), out.begin());
    return absl::OkStatus();
  }
  if (!clip_pieces_.empty()) {
    compress::ScaleByPieces(clip_pieces_, 0, out);
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<double>> sum = RepliesSumOfSquares();
  if (!sum.ok()) return sum.status();
  const float scale = compress::ClipScale(sum->value_or(0.0), max_norm_);
  if (scale != 1.0f) {
    for (float& g : out) g *= scale;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Session::OwnSumOfSquares() {
  if (!own_sum_of_squares_.has_value()) {
    absl::StatusOr<double> sum = engine_->GradientSumOfSquares();
    if (!sum.ok()) return sum.status();
    own_sum_of_squares_ = *sum;
  }
  return *own_sum_of_squares_;
}

absl::StatusOr<float> Session::OwnClipScale() {
  if (max_norm_ <= 0) return 1.0f;  // no pass over the gradient
  absl::StatusOr<double> sum = OwnSumOfSquares();
  if (!sum.ok()) return sum.status();
  return compress::ClipScale(*sum, max_norm_);
}

absl::Status Session::SendAndWait() {
  if (waited_.has_value()) return *waited_;
  absl::Status status;
  if (clips_locally_ && !local_scale_.has_value()) {
    absl::StatusOr<float> own = OwnClipScale();
    if (own.ok()) {
      local_scale_ = *own;
    } else {
      status = own.status();
    }
  }
  for (uint32_t p = 0; p < sent_.size() && status.ok(); ++p)
    status = SendPartition(p);
  absl::Status finished;
  {
    trace::Scope traced("wait for replies", step_);
    finished = exchange_->Finish(&waited_traffic_);
  }
  if (!status.ok()) {
    finished = Fail(status);  // this worker's own failure comes first
  } else if (!finished.ok()) {
    finished =
        Fail(absl::Status(finished.code(), absl::StrCat("step ", step_, ": ",
                                                        finished.message())));
  }
  waited_ = finished;
  return finished;
}

absl::StatusOr<compress::GradientNorms> Session::RepliesNorms(
    bool others) const {
  compress::GradientNorms total;
  for (const compress::Partition& p : layout_.partitions()) {
    const std::optional<DeferredReply>& reply = (*deferred_)[p.id];
    if (!reply.has_value()) {
      return absl::InternalError(
          absl::StrCat("step ", step_, ": no reply for partition ", p.id));
    }
    const ReplyExtras& norms = reply->extras;
    if (!norms.sum_of_squares.has_value() ||
        (others && !norms.other.has_value())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step_, ": the reply of partition ", p.id,
          " has no gradient norm", others ? " of order 1 or infinity" : "",
          "; is its server older than this worker?"));
    }
    total.sum_of_squares += *norms.sum_of_squares;
    if (!others) continue;
    total.other.sum_abs += norms.other->sum_abs;
    const float largest = norms.other->max_abs;
    total.other.max_abs = std::isnan(largest) || std::isnan(total.other.max_abs)
                              ? std::nanf("")
                              : std::max(total.other.max_abs, largest);
  }
  return total;
}

absl::StatusOr<std::optional<double>> Session::RepliesSumOfSquares() const {
  if (!clips_average_) {
    for (const compress::Partition& p : layout_.partitions()) {
      if (!(*deferred_)[p.id].has_value()) {
        return absl::InternalError(
            absl::StrCat("step ", step_, ": no reply for partition ", p.id));
      }
    }
    return std::nullopt;
  }
  absl::StatusOr<compress::GradientNorms> norms = RepliesNorms(false);
  if (!norms.ok()) return norms.status();
  return norms->sum_of_squares;
}

absl::Status Session::HoldsAverage() const {
  if (!InStep() || !clipped_ || !clips_average_ || clips_locally_ ||
      !waited_.has_value() || !waited_->ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_,
        ": no averaged gradient to take the norm of (after ClipAt, in a step "
        "that averages)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Session::AverageNorm(double norm_type) const {
  const bool l1 = norm_type == 1.0, l2 = norm_type == 2.0,
             linf = std::isinf(norm_type) && norm_type > 0;
  if (!(l1 || l2 || linf)) {
    return absl::InvalidArgumentError(
        absl::StrCat("norm_type ", norm_type, ": 1, 2 or inf"));
  }
  if (absl::Status s = HoldsAverage(); !s.ok()) return s;
  absl::StatusOr<compress::GradientNorms> norms = RepliesNorms(!l2);
  if (!norms.ok()) return norms.status();
  if (l2) return std::sqrt(norms->sum_of_squares);
  return l1 ? norms->other.sum_abs : static_cast<double>(norms->other.max_abs);
}

absl::Status Session::AverageGradient(absl::Span<float> out) const {
  if (out.size() != job_.algorithm.layout.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("an averaged gradient of ", job_.algorithm.layout.dim,
                     " floats, not ", out.size()));
  }
  if (absl::Status s = HoldsAverage(); !s.ok()) return s;
  for (const compress::Partition& p : layout_.partitions()) {
    const std::optional<DeferredReply>& reply = (*deferred_)[p.id];
    if (!reply.has_value()) {
      return absl::InternalError(
          absl::StrCat("step ", step_, ": no reply for partition ", p.id));
    }
    const absl::Span<float> part = out.subspan(p.range.begin, p.range.size());
    if (!reply->staged && reply->payload.empty()) {  // an idle partition
      std::fill(part.begin(), part.end(), 0.0f);
      continue;
    }
    // A reply staged by a GPU engine is read where it lies on the host.
    absl::StatusOr<absl::Span<const uint8_t>> bytes =
        reply->staged
            ? engine_->StagedReply(p)
            : absl::MakeConstSpan(
                  reinterpret_cast<const uint8_t*>(reply->payload.data()),
                  reply->payload.size());
    if (!bytes.ok()) return bytes.status();
    const compress::ReplyRule rule =
        compress::PlanReply(job_.algorithm, step_, HyperOf(step_hyper_, p));
    if (absl::Status s = compress::Decode(rule.codec, *bytes, part); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status Session::Fail(absl::Status status) {
  if (!failed_.ok()) return status;  // the job was stopped at the first failure
  failed_ = status;
  // In an elastic job this worker's failure is its own: the shards complete
  // the steps without it (min_workers), and it may come back (--rejoin).
  if (job_.elastic()) return status;
  // The other workers would wait for this one's pushes until the recovery
  // timeout: stop the job on the shards, so they fail now with the reason.
  if (absl::Status s = client_->Abort(step_, std::string(status.message()));
      !s.ok()) {
    std::fprintf(
        stderr,
        "worker %u: could not tell the shards that step %lld failed: %s\n",
        rank_, static_cast<long long>(step_), std::string(s.message()).c_str());
  }
  return status;
}

void Session::NoteAbsent(std::map<uint32_t, std::vector<uint32_t>> absent) {
  absent_.clear();
  std::vector<uint32_t> own;  // partitions that left this worker out
  for (auto& [partition, ranks] : absent) {
    if (std::binary_search(ranks.begin(), ranks.end(), rank_))
      own.push_back(partition);
    absent_.resize(partition + 1);
    absent_[partition] = std::move(ranks);
  }
  if (!own.empty() && left_out_from_ < 0) {
    std::fprintf(stderr,
                 "worker %u: step %lld completed without this worker's push of "
                 "partition(s) %s (late by timeouts.step_seconds or "
                 "straggler_seconds, or replayed after a restart; "
                 "min_workers): this worker applies the step as every other "
                 "does, and says when a step has it again\n",
                 rank_, static_cast<long long>(step_),
                 absl::StrJoin(own, ", ").c_str());
    left_out_from_ = step_;
  } else if (own.empty() && left_out_from_ >= 0) {
    std::fprintf(
        stderr,
        "worker %u: step %lld has this worker's pushes again, after %lld "
        "step(s) without (%lld..%lld)\n",
        rank_, static_cast<long long>(step_),
        static_cast<long long>(left_out_steps_),
        static_cast<long long>(left_out_from_),
        static_cast<long long>(step_ - 1));
    left_out_from_ = -1;
    left_out_steps_ = 0;
  }
  if (!own.empty()) ++left_out_steps_;
}

std::vector<uint32_t> Session::RanksWhere(bool member) const {
  std::vector<bool> in(job_.workers(), true);
  for (const std::vector<uint32_t>& ranks : absent_) {
    for (uint32_t r : ranks) in[r] = false;
  }
  std::vector<uint32_t> ranks;
  for (uint32_t r = 0; r < job_.workers(); ++r) {
    if (in[r] == member) ranks.push_back(r);
  }
  return ranks;
}

absl::Status Session::Finish(StepTraffic* traffic) {
  if (!InStep())
    return absl::FailedPreconditionError("no step in progress (call Begin)");
  if (local_pending_) {
    if (absl::Status s = LocalStep(); !s.ok()) {
      return Fail(absl::Status(
          s.code(), absl::StrCat("step ", step_, ": ", s.message())));
    }
    if (exchange_ == nullptr) {  // a local step: nothing to send
      if (traffic != nullptr) *traffic = StepTraffic{};
      received_buffers_.clear();
      absent_.clear();
      ++step_;
      return absl::OkStatus();
    }
  }
  absl::Status finished = SendAndWait();
  StepTraffic waited_traffic = waited_traffic_;
  received_buffers_ = exchange_->TakeReceivedBuffers();
  NoteAbsent(exchange_->TakeAbsent());
  exchange_.reset();
  if (traffic != nullptr) *traffic = waited_traffic;
  if (!finished.ok()) return finished;
  std::optional<double> sum_of_squares;
  if (deferred_ != nullptr) {
    absl::StatusOr<std::optional<double>> sum = RepliesSumOfSquares();
    if (!sum.ok()) return Fail(sum.status());
    sum_of_squares = *sum;
    // The averaged gradient's clip factor needs every partition's norm.
    const float scale =
        clips_average_ ? compress::ClipScale(*sum_of_squares, max_norm_) : 1.0f;
    for (const compress::Partition& p : layout_.partitions()) {
      const DeferredReply& reply = *(*deferred_)[p.id];
      const absl::Span<const uint8_t> bytes(
          reinterpret_cast<const uint8_t*>(reply.payload.data()),
          reply.payload.size());
      const compress::StepHyper* hyper = HyperOf(step_hyper_, p);
      trace::Scope traced("apply", step_, p.id);
      const compress::ClipPieces pieces =
          compress::ClipPiecesOf(clip_pieces_, p.range.begin, p.range.end);
      absl::Status s;
      if (!amended_.empty() && (reply.staged || !reply.payload.empty())) {
        s = engine_->ApplyAmended(step_, p,
                                  absl::MakeConstSpan(amended_).subspan(
                                      p.range.begin, p.range.size()),
                                  hyper);
      } else if (reply.staged) {
        s = engine_->ApplyStagedReply(step_, p, hyper, scale, pieces);
      } else {
        s = engine_->ApplyReply(step_, p, bytes, hyper, scale,
                                reply.extras.piece_stats, pieces);
      }
      if (!s.ok()) {
        return Fail(
            absl::Status(s.code(), absl::StrCat("step ", step_, ": partition ",
                                                p.id, ": ", s.message())));
      }
    }
    deferred_.reset();
  }
  absl::Status synced;
  {
    trace::Scope traced(engine_->kind() == "cpu" ? nullptr : "device sync",
                        step_);
    synced = engine_->FinishApplies();
  }
  if (!synced.ok()) {
    return Fail(absl::Status(
        synced.code(), absl::StrCat("step ", step_, ": ", synced.message())));
  }
  previous_grad_sum_of_squares_ = sum_of_squares;
  const bool chose_max_norm = workers_clip_ && sum_of_squares.has_value();
  previous_clip_max_norm_ =
      chose_max_norm ? std::optional<float>(max_norm_) : std::nullopt;
  previous_clip_pieces_ =
      chose_max_norm ? std::move(clip_pieces_) : compress::ClipPieces();
  clip_pieces_.clear();
  previous_amended_ =
      chose_max_norm && !amended_.empty()
          ? std::make_shared<const std::vector<float>>(std::move(amended_))
          : nullptr;
  amended_.clear();
  const bool commits = compress::CommitsLayers(job_.algorithm);
  if (commits) {
    // The optimizer's step from sums over the whole model (onebit_lamb: x
    // moves by each layer's coefficient), and its commit.
    trace::Scope traced("commit step", step_);
    absl::StatusOr<std::vector<double>> commit =
        engine_->CommitStep(step_, step_hyper_, pool_.get());
    if (!commit.ok()) {
      return Fail(absl::Status(
          commit.status().code(),
          absl::StrCat("step ", step_, ": ", commit.status().message())));
    }
    previous_commit_ = *std::move(commit);
  }
  if (absl::Status s = CommitLastStep(step_); !s.ok()) {
    return Fail(absl::Status(s.code(),
                             absl::StrCat("step ", step_, ": ", s.message())));
  }
  if (trace_step_start_ >= 0) trace::Complete("step", trace_step_start_, step_);
  if (step_ == x_hash_step_) shown_x_ = std::vector<float>();
  ++step_;
  return absl::OkStatus();
}

absl::Status Session::Step(absl::Span<const float> grad, StepTraffic* traffic) {
  if (absl::Status s = Begin(grad); !s.ok()) return s;
  return Finish(traffic);
}

namespace {

// Doubles kept bit for bit in a checkpoint's int64 arrays.
std::vector<int64_t> DoubleBits(absl::Span<const double> values) {
  std::vector<int64_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), 8 * values.size());
  return bits;
}

std::vector<double> BitsDouble(absl::Span<const int64_t> bits) {
  std::vector<double> values(bits.size());
  std::memcpy(values.data(), bits.data(), 8 * bits.size());
  return values;
}

}  // namespace

// The step after the last exchange up to `step` (Session::exchanged_step).
static int64_t ExchangedStep(const compress::AlgorithmConfig& algorithm,
                             int64_t step) {
  while (step > 0 && !compress::PlanStep(algorithm, step - 1).exchanges) --step;
  return step;
}

int64_t Session::exchanged_step() const {
  return ExchangedStep(job_.algorithm, step_);
}

absl::Status Session::SaveCheckpoint(const std::string& path) const {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  // The error buffer changes only at exchanges: after zero_one_adam's local
  // steps it is the one of the step after the last sync, where the shards
  // are and where a resumed worker that takes x, m, v from them starts.
  const int64_t step = exchanged_step();
  proto::CheckpointWriter writer(
      {"worker", rank_, layout_.fingerprint(),
       compress::AlgorithmFingerprint(job_.algorithm), step});
  std::vector<float> error(job_.algorithm.layout.dim);
  error_.Read(0, absl::MakeSpan(error));
  writer.AddFloats("worker_error", error);
  // The whole state at step_ too, so that this worker, restarted, can start
  // here and replay the steps the shards completed since (Start).
  const int64_t whole_step = step_;
  writer.AddInts("whole_step", {&whole_step, 1});
  writer.AddFloats("x", replica_.x());
  writer.AddFloats("m", replica_.m());
  writer.AddFloats("v", replica_.v());
  if (previous_grad_sum_of_squares_.has_value()) {
    writer.AddInts("previous_grad_sum_of_squares",
                   DoubleBits({&*previous_grad_sum_of_squares_, 1}));
  }
  if (previous_clip_max_norm_.has_value())
    writer.AddFloats("previous_clip_max_norm", {&*previous_clip_max_norm_, 1});
  if (!previous_clip_pieces_.empty()) {
    std::vector<int64_t> ends;
    std::vector<float> scales;
    for (const compress::ClipPiece& piece : previous_clip_pieces_) {
      ends.push_back(static_cast<int64_t>(piece.end));
      scales.push_back(piece.scale);
    }
    writer.AddInts("previous_clip_piece_ends", ends);
    writer.AddFloats("previous_clip_piece_scales", scales);
  }
  if (previous_amended_ != nullptr)
    writer.AddFloats("previous_amended", *previous_amended_);
  // The optimizer's own arrays (onebit_lamb's v' and layer state).
  for (const compress::NamedState& array :
       replica_.SaveState(0, job_.algorithm.layout.dim)) {
    writer.AddFloats(array.name, array.values);
  }
  if (compress::CommitsLayers(job_.algorithm))
    writer.AddInts("previous_lamb_commit", DoubleBits(previous_commit_));
  if (whole_step != step) {  // inside a local interval (zero_one_adam's)
    for (const compress::NamedState& array : replica_.SaveInterval())
      writer.AddFloats(array.name, array.values);
    const int64_t last = replica_.last_local_step();
    writer.AddInts("last_local_step", {&last, 1});
  }
  return writer.Write(path);
}

absl::Status Session::RestoreWholeState(const proto::CheckpointReader& reader,
                                        int64_t whole_step) {
  const uint64_t dim = job_.algorithm.layout.dim;
  const auto floats = [&](const char* name, uint64_t n,
                          std::vector<float>* out) {
    auto values = reader.Floats(name, n);
    if (values.ok()) *out = *std::move(values);
    return values.status();
  };
  std::vector<float> x, m, v, error;
  for (auto [name, out] :
       {std::pair{"x", &x}, {"m", &m}, {"v", &v}, {"worker_error", &error}}) {
    if (absl::Status s = floats(name, dim, out); !s.ok()) return s;
  }
  std::optional<double> norm;
  if (reader.Has("previous_grad_sum_of_squares")) {
    auto bits = reader.Ints("previous_grad_sum_of_squares", 1);
    if (!bits.ok()) return bits.status();
    norm = BitsDouble(*bits)[0];
  }
  std::optional<float> max_norm;
  if (reader.Has("previous_clip_max_norm")) {
    std::vector<float> value;
    if (absl::Status s = floats("previous_clip_max_norm", 1, &value); !s.ok())
      return s;
    max_norm = value[0];
  }
  compress::ClipPieces pieces;
  if (reader.Has("previous_clip_piece_ends")) {
    const uint64_t count = reader.Count("previous_clip_piece_ends");
    auto ends = reader.Ints("previous_clip_piece_ends", count);
    if (!ends.ok()) return ends.status();
    std::vector<float> scales;
    if (absl::Status s = floats("previous_clip_piece_scales", count, &scales);
        !s.ok())
      return s;
    for (uint64_t i = 0; i < count; ++i)
      pieces.push_back({static_cast<uint64_t>((*ends)[i]), scales[i]});
    if (absl::Status s = compress::ValidateClipPieces(pieces, dim); !s.ok()) {
      return absl::DataLossError(
          absl::StrCat(reader.path(), ": ", s.message()));
    }
  }
  std::shared_ptr<const std::vector<float>> amended;
  if (reader.Has("previous_amended")) {
    std::vector<float> values;
    if (absl::Status s = floats("previous_amended", dim, &values); !s.ok())
      return s;
    amended = std::make_shared<const std::vector<float>>(std::move(values));
  }
  std::vector<compress::NamedState> own;
  for (const compress::StateArray& array :
       compress::OptimizerOf(job_.algorithm).State(job_.algorithm)) {
    compress::NamedState& read = own.emplace_back();
    read.name = array.name;
    if (absl::Status s =
            floats(array.name.c_str(), array.per_element ? dim : array.floats,
                   &read.values);
        !s.ok())
      return s;
  }
  if (absl::Status s =
          compress::CheckState(job_.algorithm, dim, own, reader.path());
      !s.ok()) {
    return absl::DataLossError(s.message());
  }
  // The optimizer's last commit, under the key it had before the seam.
  std::vector<double> commit;
  const bool commits = compress::CommitsLayers(job_.algorithm);
  if (commits) {
    if (!reader.Has("previous_lamb_commit")) {
      return absl::DataLossError(
          absl::StrCat(reader.path(), " has no previous_lamb_commit"));
    }
    auto bits = reader.Ints("previous_lamb_commit",
                            reader.Count("previous_lamb_commit"));
    if (!bits.ok()) return bits.status();
    commit = BitsDouble(*bits);
  }
  std::optional<std::vector<compress::NamedState>> interval;
  int64_t last_local_step = -1;
  if (whole_step != reader.header().step) {
    interval.emplace();
    for (const compress::StateArray& array :
         compress::OptimizerOf(job_.algorithm).IntervalState(job_.algorithm)) {
      compress::NamedState& read = interval->emplace_back();
      read.name = array.name;
      // A per-element array is saved empty where no interval holds it.
      const uint64_t n = !array.per_element              ? array.floats
                         : reader.Count(array.name) == 0 ? 0
                                                         : dim;
      if (absl::Status s = floats(array.name.c_str(), n, &read.values); !s.ok())
        return s;
    }
    if (absl::Status s = compress::CheckInterval(job_.algorithm, dim, *interval,
                                                 reader.path());
        !s.ok()) {
      return absl::DataLossError(s.message());
    }
    auto last = reader.Ints("last_local_step", 1);
    if (!last.ok()) return last.status();
    last_local_step = (*last)[0];
  }
  // Everything read: now change the session.
  if (absl::Status s = error_.Restore(error); !s.ok()) return s;
  if (interval.has_value()) {
    if (absl::Status s = replica_.RestoreInterval(*interval, last_local_step);
        !s.ok())
      return s;
  }
  std::copy(x.begin(), x.end(), replica_.x().begin());
  std::copy(m.begin(), m.end(), replica_.mutable_m().begin());
  std::copy(v.begin(), v.end(), replica_.mutable_v().begin());
  if (absl::Status s = replica_.RestoreState(0, dim, own); !s.ok()) return s;
  if (commits) previous_commit_ = std::move(commit);
  previous_grad_sum_of_squares_ = norm;
  previous_clip_max_norm_ = max_norm;
  previous_clip_pieces_ = std::move(pieces);
  previous_amended_ = std::move(amended);
  return absl::OkStatus();
}

absl::Status Session::CheckOwnState(const OwnState* own) const {
  const compress::Optimizer& optimizer = compress::OptimizerOf(job_.algorithm);
  const uint64_t commit_values = optimizer.CommitDoubles(job_.algorithm);
  if (own == nullptr) {
    if (optimizer.State(job_.algorithm).empty() && commit_values == 0)
      return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", optimizer.name(),
        " state needs its own arrays and last commit (the optimizer's "
        "state_dict() saves them)"));
  }
  if (absl::Status s = compress::CheckState(
          job_.algorithm, job_.algorithm.layout.dim, own->arrays,
          absl::StrCat(optimizer.name(), " state"));
      !s.ok()) {
    return s;
  }
  if (own->commit.empty()) return absl::OkStatus();
  if (own->commit.size() != commit_values) {
    return absl::InvalidArgumentError(absl::StrCat(
        optimizer.name(), " state: a commit of ", own->commit.size(),
        " values (needs 0 or ", commit_values, ")"));
  }
  return optimizer.ValidateCommit(job_.algorithm, own->commit);
}

absl::StatusOr<Session::OwnState> Session::SavedOwn() {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  if (absl::Status s = SyncHost(); !s.ok()) return s;
  OwnState state;
  state.arrays = replica_.SaveState(0, job_.algorithm.layout.dim);
  state.commit = previous_commit_;
  return state;
}

absl::StatusOr<Session::IntervalState> Session::SavedInterval() {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  if (exchanged_step() == step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_, " is not inside a zero_one_adam local interval"));
  }
  if (absl::Status s = SyncHost(); !s.ok()) return s;
  IntervalState state;
  state.arrays = replica_.SaveInterval();
  state.last_local_step = replica_.last_local_step();
  return state;
}

absl::Status Session::ShardsAtSync(absl::Span<float> m,
                                   absl::Span<float> server_error) {
  const uint64_t dim = job_.algorithm.layout.dim;
  if (m.size() != dim || server_error.size() != dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the shards' m and error buffers have ", dim, " elements each"));
  }
  absl::StatusOr<IntervalState> interval = SavedInterval();
  if (!interval.ok()) return interval.status();
  const int64_t synced = exchanged_step();
  compress::Replica shards(job_.algorithm, {0, dim});
  auto steps = client_->FetchModel(shards);
  if (!steps.ok()) return steps.status();
  auto error_steps = client_->FetchServerError(server_error);
  if (!error_steps.ok()) return error_steps.status();
  if (*error_steps != *steps) {
    return absl::UnavailableError(
        "the shards moved on while their state was read");
  }
  // The interval's anchor is x at its last sync, which the shards hold
  // (design.md 2.7: a shard's mirror never leaves it).
  const auto anchor = std::find_if(
      interval->arrays.begin(), interval->arrays.end(),
      [](const compress::NamedState& a) { return a.name == "anchor"; });
  const bool at_sync =
      *steps == synced &&
      (anchor == interval->arrays.end() || anchor->values.empty() ||
       std::equal(anchor->values.begin(), anchor->values.end(),
                  shards.x().begin(), [](float a, float b) {
                    return absl::bit_cast<uint32_t>(a) ==
                           absl::bit_cast<uint32_t>(b);
                  }));
  if (!at_sync) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the shards have completed ", *steps,
        " steps, this worker's interval "
        "started after step ",
        synced, *steps == synced ? ", and their x is not its anchor" : "",
        ": they no longer hold its last sync"));
  }
  std::copy(shards.m().begin(), shards.m().end(), m.begin());
  return absl::OkStatus();
}

absl::Status Session::ReloadModel() {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  // Between a step that exchanged and a local one (zero_one_adam's interval
  // begins) x becomes the interval's anchor: the job's, as before a step
  // that exchanges, the pushes of the interval's sync showing it.
  if (!compress::TakesChangedX(job_.algorithm, step_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step_,
        " continues a local interval of zero_one_adam (design.md 2.7): the "
        "shards hold the interval's anchor, so weights become the job's "
        "only between a step that exchanged and the next one; inside an "
        "interval they are each rank's own until its sync"));
  }
  auto held = client_->CompletedSteps();
  if (held.ok() ? *held < step_ : Retryable(held.status())) {
    // A shard restarted from its checkpoint since the last step (or is
    // restarting): the workers' replays bring it to this step first.
    if (absl::Status s = CatchUpShards(); !s.ok()) return s;
    held = client_->CompletedSteps();
  }
  if (!held.ok()) return held.status();
  if (*held > step_) {
    // A rank restarted from its checkpoint and replaying steps the shards
    // have completed: they changed the weights then; this rank's replayed
    // pushes are checked against the ones it made (their hashes). In an
    // elastic job it may have been left out of this step (a straggler, or
    // back from a restart): no push of its own to compare with, so its
    // push shows x (ShardCore::CheckLeftOutX).
    if (absl::Status s = SyncHost(); !s.ok()) return s;
    ShowXAtNextExchange();
    return absl::OkStatus();
  }
  if (*held < step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the shards hold step ", *held, " and this worker is at step ", step_,
        " (zero_one_adam's local steps do not reach them): weights change "
        "after a step that exchanged, before one that exchanges"));
  }
  // From here a failure leaves the ranks with different models: it stops
  // the job, so the others learn why at once instead of waiting for this
  // rank's pushes.
  if (absl::Status s = SyncHost(); !s.ok()) return Fail(s);
  const uint64_t dim = job_.algorithm.layout.dim;
  if (step_ > 0) return ReplaceModel();
  if (rank_ == 0) {
    const std::vector<float> server_error(dim, 0.0f);
    absl::Status s =
        client_->RestoreModel(0, replica_.x(), replica_.m(), replica_.v(),
                              server_error, replica_.SaveState(0, dim));
    if (absl::IsFailedPrecondition(s)) {
      s = absl::FailedPreconditionError(absl::StrCat(
          s.message(),
          " (another rank pushed step 0 from the weights its optimizer was "
          "built with: when weights are loaded after building the "
          "optimizer, load them on every rank)"));
    }
    return s.ok() ? s : Fail(s);
  }
  return AwaitShardsX();
}

void Session::ShowXAtNextExchange() {
  x_hash_step_ = compress::NextExchange(job_.algorithm, step_);
  // Before a zero_one_adam interval x moves by the local steps until the
  // sync, whose pushes show the interval's anchor: x as it is now.
  if (x_hash_step_ != step_) {
    shown_x_.assign(replica_.x().begin(), replica_.x().end());
  } else {
    shown_x_.clear();
  }
}

absl::Status Session::ReplaceModel() {
  if (rank_ == 0) {
    absl::Status s = client_->ReplaceX(step_, replica_.x());
    if (absl::IsFailedPrecondition(s)) {
      s = absl::FailedPreconditionError(
          absl::StrCat(s.message(), " (rank 0 changed its weights after step ",
                       step_ - 1, ")"));
    }
    if (!s.ok()) return Fail(s);
    ShowXAtNextExchange();
    return s;
  }
  return AwaitShardsX();
}

absl::Status Session::AwaitShardsX() {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  // Rank 0's upload is usually in within a few download times: ask again
  // soon, then less often.
  absl::Duration pause = absl::Milliseconds(5);
  for (;;) {
    // FAILED_PRECONDITION: partitions at different steps (rank 0's restore
    // half done); after a step also UNAVAILABLE: a partition waits for its
    // commit (before the first step nothing does). Only the partitions'
    // hashes of x cross the wire.
    auto shards = client_->CompareX(replica_.x());
    if (!shards.ok() && !absl::IsFailedPrecondition(shards.status()) &&
        !(step_ > 0 && absl::IsUnavailable(shards.status()))) {
      return Fail(shards.status());
    }
    if (step_ > 0 && (!shards.ok() || shards->completed_steps < step_)) {
      // A shard restarted from its checkpoint since the last step needs
      // this rank's replays too before rank 0 can give it the weights.
      if (absl::Status s = CatchUpShards(); !s.ok()) return Fail(s);
    }
    if (shards.ok() && shards->completed_steps > step_) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "the shards completed step ", step_, " while rank ", rank_,
          " waited for rank 0 to give them the same weights")));
    }
    if (shards.ok() && shards->completed_steps == step_ && shards->same) {
      ShowXAtNextExchange();
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank_, " changed its weights ",
          step_ == 0 ? "after building the optimizer"
                     : absl::StrCat("after step ", step_ - 1),
          ", but within ", job_.connect_timeout_seconds,
          " s (timeouts.connect_seconds) rank 0 did not give the shards the "
          "same ones: ",
          step_ == 0 ? "load the same weights on every rank"
                     : "change the weights the same way on every rank",
          job_.elastic() ? " (in an elastic job rank 0 gives them: it must "
                           "still be in the job)"
                         : "")));
    }
    absl::SleepFor(pause);
    pause = std::min(2 * pause, absl::Milliseconds(100));
  }
}

absl::Status Session::CommitLastStep(int64_t step) {
  const bool commits = compress::CommitsLayers(job_.algorithm);
  if (!(commits || previous_grad_sum_of_squares_.has_value()) ||
      !(rank_ == 0 || job_.elastic())) {
    return absl::OkStatus();
  }
  // The shards' mirrors apply the step once they have its commit (the
  // averaged gradient's norm, the optimizer's values, or both in one);
  // the next step's pushes carry it as well, so only rank 0 waits for
  // this, or in an elastic job every rank (the same commit again is OK):
  // rank 0 may have left, and the job's last step has no next pushes.
  return client_->Commit(
      step, previous_grad_sum_of_squares_, previous_clip_max_norm_,
      commits ? absl::MakeConstSpan(previous_commit_)
              : absl::Span<const double>(),
      previous_clip_pieces_,
      previous_amended_ != nullptr ? absl::MakeConstSpan(*previous_amended_)
                                   : absl::Span<const float>());
}

absl::Status Session::CatchUpShards() {
  absl::StatusOr<bool> replayed =
      ShardRecovery::CatchUpBetweenSteps(client_.get(), step_);
  if (!replayed.ok()) return replayed.status();
  // The last step, replayed, waits for its commit, which Finish sent
  // before the shard restarted and the next step's pushes would carry.
  if (!*replayed || step_ == 0) return absl::OkStatus();
  return CommitLastStep(step_ - 1);
}

absl::StatusOr<bool> Session::HoldsShardsModel() {
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  if (absl::Status s = SyncHost(); !s.ok()) return s;
  // A step waiting for rank 0's commit (clipping, onebit_lamb) answers
  // UNAVAILABLE until it arrives, partitions between steps
  // FAILED_PRECONDITION: asked again, up to the connect timeout. Only the
  // partitions' hashes of x cross the wire (PushRequest.x_hash's, which
  // the pushes then carry: the check relies on them either way).
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  absl::Duration pause = absl::Milliseconds(5);
  auto shards = client_->CompareX(replica_.x());
  while (!shards.ok() &&
         (absl::IsUnavailable(shards.status()) ||
          absl::IsFailedPrecondition(shards.status())) &&
         absl::Now() < deadline) {
    // A shard restarted from its checkpoint since the last step (or
    // restarting) is behind until the workers' replays bring it to this
    // step: they go now. (Nothing is sent where no shard is behind.)
    if (absl::Status s = CatchUpShards(); !s.ok()) return s;
    absl::SleepFor(pause);
    pause = std::min(2 * pause, absl::Milliseconds(100));
    shards = client_->CompareX(replica_.x());
  }
  if (shards.ok() && shards->completed_steps < step_) {
    // Every shard behind: restarted from checkpoints of one step (or
    // zero_one_adam's local steps, which they do not see).
    if (absl::Status s = CatchUpShards(); !s.ok()) return s;
    shards = client_->CompareX(replica_.x());
  }
  if (!shards.ok()) return shards.status();
  const bool holds = shards->completed_steps == step_ && shards->same;
  // The shards may hold this x because rank 0 has just given it to them
  // (ReloadModel: the same change on every rank): the pushes of this step
  // must then show it (PushRequest.x_hash), as a changing rank's do.
  if (holds) ShowXAtNextExchange();
  return holds;
}

absl::Status Session::ServerError(absl::Span<float> out) {
  const uint64_t dim = job_.algorithm.layout.dim;
  if (out.size() != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("the server error has ", dim, " elements"));
  }
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  auto steps = client_->FetchServerError(out);
  if (steps.ok() ? *steps < step_
                 : Retryable(steps.status()) ||
                       steps.status()
                           .GetPayload(PushClient::kMixedStepsKey)
                           .has_value()) {
    // A shard restarted from its checkpoint since the last step: the
    // workers' replays bring it to this step first.
    if (absl::Status s = CatchUpShards(); !s.ok()) return s;
    steps = client_->FetchServerError(out);
  }
  if (!steps.ok()) return steps.status();
  if (*steps != step_) {
    const compress::StepPlan last =
        compress::PlanStep(job_.algorithm, step_ - 1);
    const bool local = step_ > 0 && last.local && !last.exchanges;
    return absl::FailedPreconditionError(absl::StrCat(
        "the shards have completed ", *steps, " steps, this worker ", step_,
        local ? "; zero_one_adam: this worker is in the middle of a local "
                "interval, and the shards "
                "hold its last sync: save the state right after a sync step"
              : ""));
  }
  return absl::OkStatus();
}

absl::Status Session::Restore(int64_t step, absl::Span<const float> m,
                              absl::Span<const float> v,
                              absl::Span<const float> error,
                              absl::Span<const float> server_error,
                              const OwnState* own,
                              const IntervalState* interval) {
  const uint64_t dim = job_.algorithm.layout.dim;
  if (step < 0 || m.size() != dim || v.size() != dim ||
      (!server_error.empty() && server_error.size() != dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state needs step >= 0 and m, v (and the server "
                     "error, if given) of ",
                     dim, " elements"));
  }
  if (InStep()) return absl::FailedPreconditionError("a step is in progress");
  if (absl::Status s = CheckOwnState(own); !s.ok()) return s;
  // Where the shards must be: the step itself, or inside a local interval
  // the step after its last sync.
  const int64_t shard_step = ExchangedStep(job_.algorithm, step);
  if ((shard_step != step) != (interval != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step,
        shard_step != step
            ? absl::StrCat(" is inside a zero_one_adam local interval (its "
                           "last sync completed step ",
                           shard_step, "): its state needs the interval's")
            : " is not inside a local interval, yet an interval's state was "
              "given"));
  }
  std::vector<float> anchor;  // the shards' x at the interval's last sync
  if (interval != nullptr) {
    if (absl::Status s = compress::CheckInterval(
            job_.algorithm, dim, interval->arrays, "the local interval");
        !s.ok()) {
      return s;
    }
    if (interval->last_local_step != step - 1 ||
        (!interval->shards_m.empty() && interval->shards_m.size() != dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the local interval's state of step ", step,
                       " needs its last local step ", step - 1, " (given ",
                       interval->last_local_step, ") and the shards' m of ",
                       dim, " elements or none"));
    }
    for (const compress::NamedState& array : interval->arrays)
      if (array.name == "anchor") anchor = array.values;
    if (anchor.size() != dim) {
      return absl::InvalidArgumentError(
          "the local interval's state has no anchor");
    }
  }
  auto held = client_->CompletedSteps();
  if (!held.ok()) return held.status();
  if (*held != shard_step) {
    if (*held != 0 || step_ != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shards hold step ", *held, " of this job, the saved state step ",
          shard_step, "; load a state saved at step ", *held,
          ", or restart the shards fresh (or from their "
          "checkpoints of step ",
          shard_step, ") and load it before the first step()"));
    }
    if (rank_ == 0) {
      if (server_error.empty() ||
          (interval != nullptr && interval->shards_m.empty())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the shards are fresh and this state (step ", step,
            ") has no server state: save rank "
            "0's optimizer.state_dict() (it holds the shards' "
            "error buffers",
            interval != nullptr ? " and m at the interval's sync" : "",
            ") and load it on rank 0"));
      }
      if (absl::Status s = SyncHost(); !s.ok()) return s;
      // Inside a local interval the shards hold its last sync: its anchor
      // and m, the frozen v.
      if (absl::Status s = client_->RestoreModel(
              shard_step,
              interval != nullptr ? absl::MakeConstSpan(anchor) : replica_.x(),
              interval != nullptr ? absl::MakeConstSpan(interval->shards_m) : m,
              v, server_error,
              own != nullptr ? absl::MakeConstSpan(own->arrays)
                             : absl::Span<const compress::NamedState>());
          !s.ok()) {
        return s;
      }
    } else {
      const absl::Time deadline =
          absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
      while (*held != shard_step) {
        if (absl::Now() > deadline) {
          return absl::FailedPreconditionError(
              absl::StrCat("waited ", job_.connect_timeout_seconds,
                           " s for rank 0 to restore the shards to step ",
                           shard_step, " (they hold step ", *held,
                           "); load the saved state on every rank"));
        }
        absl::SleepFor(absl::Milliseconds(50));
        held = client_->CompletedSteps();
        if (!held.ok()) return held.status();
      }
    }
  }
  // On the GPU the host x is stale: bring it over first, so the upload
  // below keeps the device's parameters.
  if (absl::Status s = SyncHost(); !s.ok()) return s;
  if (absl::Status s = error_.Restore(error); !s.ok()) return s;
  std::copy(m.begin(), m.end(), replica_.mutable_m().begin());
  std::copy(v.begin(), v.end(), replica_.mutable_v().begin());
  if (own != nullptr) {
    if (absl::Status s =
            replica_.RestoreState(0, job_.algorithm.layout.dim, own->arrays);
        !s.ok())
      return s;
    previous_commit_ = own->commit;
  } else {
    previous_commit_.clear();
  }
  if (interval != nullptr) {
    if (absl::Status s = replica_.RestoreInterval(interval->arrays,
                                                  interval->last_local_step);
        !s.ok())
      return s;
  }
  step_ = step;
  previous_grad_sum_of_squares_.reset();
  previous_clip_max_norm_.reset();
  previous_clip_pieces_.clear();
  previous_amended_ = nullptr;
  return engine_->Load(replica_, error_);
}

}  // namespace morse::worker
