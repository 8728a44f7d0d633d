#include "worker/step_exchange.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "compress/bytes_hash.h"
#include "compress/sync.h"
#include "compress/trace.h"
#include "proto/wire.h"
#include "worker/client.h"
#include "worker/rpc_status.h"

namespace morse::worker {

struct StepExchange::Call {
  v1::PushRequest request;
  v1::PushReply reply;
  const compress::Partition* partition = nullptr;
  absl::Time first_failure = absl::InfiniteFuture();  // of the current outage
  int attempt = 0;
  int64_t issued_us = -1;  // the trace's clock, when tracing
  // A replay: this call re-sends a retained push whose reply must hash to
  // `expected_hash`; `then` is the refused push to send once caught up, or
  // null for ReplayCompleted's re-sends, which go on through `replay_last`.
  bool replay = false;
  std::unique_ptr<Call> then;
  uint64_t expected_hash = 0;
  int64_t replay_last = -1;
};

StepExchange::StepExchange(PushClient* client, compress::ComputePool* pool,
                           int64_t step, compress::CodecKind up, Apply apply,
                           StepExtras extras, bool parallel_encode)
    : client_(client),
      pool_(pool),
      step_(step),
      wire_codec_(proto::ToWire(up)),
      parallel_encode_(parallel_encode),
      apply_(std::move(apply)),
      extras_(std::move(extras)),
      restarted_from_(client->transport_->shards(), -1),
      caught_up_(client->layout_.partitions().size(), false),
      sent_(client->layout_.partitions().size(), false),
      replayed_ahead_(client->layout_.partitions().size(), false) {}

std::string StepExchange::TakeReceivedBuffers() {
  MutexLock lock(&mu_);
  return std::move(received_buffers_);
}

std::map<uint32_t, std::vector<uint32_t>> StepExchange::TakeAbsent() {
  MutexLock lock(&mu_);
  return std::move(absent_);
}

StepExchange::~StepExchange() {
  {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StepExchange::Idle));
    closing_ = true;
  }
  if (sender_.joinable()) sender_.join();
}

bool StepExchange::CanSend() const {
  return in_flight_ < client_->job_.window || !error_.ok();
}

bool StepExchange::Idle() const { return in_flight_ == 0 && queue_.empty(); }

void StepExchange::SendQueued() {
  for (;;) {
    Queued next;
    {
      MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepExchange* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return self->closing_ || (!self->queue_.empty() && self->CanSend());
          },
          this));
      if (queue_.empty()) return;  // closing
      if (!error_.ok()) {          // the step failed: nothing more is sent
        queue_.clear();
        continue;
      }
      next = std::move(queue_.front());
      queue_.pop_front();
      ++in_flight_;
      sent_[next.call->partition->id] = true;
    }
    pool_->Schedule([this, call = std::move(next.call),
                     encode = std::move(next.encode)]() mutable {
      (void)EncodeAndIssue(std::move(call), encode, /*inline_call=*/false);
    });
  }
}

void StepExchange::Issue(std::unique_ptr<Call> call) {
  ++call->attempt;
  if (trace::Enabled()) call->issued_us = trace::NowMicros();
  // The completion owns the call and destroys it before it signals the
  // step: once Finish() returns, nothing of this step is left in flight.
  Call* raw = call.release();
  client_->transport_->Push(
      raw->partition->shard, raw->request, &raw->reply,
      client_->Options(client_->job_.rpc_timeout_seconds, raw->partition->id),
      [this, raw](absl::Status status) { OnDone(raw, std::move(status)); });
}

void StepExchange::RetryLater(std::unique_ptr<Call> call) {
  const absl::Duration backoff =
      absl::Milliseconds(std::min(50 << std::min(call->attempt, 5), 1000));
  // On the client's timer thread, never sleeping on the transport's.
  client_->timer_.After(backoff, [this, raw = call.release()] {
    Issue(std::unique_ptr<Call>(raw));
  });
}

void StepExchange::Fail(const compress::Partition& partition,
                        absl::Status status) {
  MutexLock lock(&mu_);
  if (error_.ok()) {
    error_ = absl::Status(
        status.code(),
        absl::StrCat("partition ", partition.id, " of step ", step_, " on ",
                     client_->transport_->address(partition.shard), ": ",
                     status.message()));
  }
  --in_flight_;
}

absl::StatusOr<std::unique_ptr<StepExchange::Call>> StepExchange::RetainedPush(
    const compress::Partition& partition, int64_t step) {
  std::optional<PushClient::Retained> retained =
      client_->Find(step, partition.id);
  if (!retained.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the shard restarted from its checkpoint and needs this worker's push "
        "of step ",
        step, ", which it no longer holds (it keeps checkpoint.replay_steps = ",
        client_->job_.replay_steps,
        " steps; it must be at least checkpoint.every_steps + 1)"));
  }
  auto replay = std::make_unique<Call>();
  replay->partition = &partition;
  replay->request = std::move(retained->request);
  replay->expected_hash = retained->reply_hash;
  replay->replay = true;
  return replay;
}

absl::Status StepExchange::StartReplay(std::unique_ptr<Call> call,
                                       int64_t from) {
  const int64_t until =
      call->request.step();  // replay [from, until), then call
  const uint32_t id = call->partition->id;
  absl::StatusOr<std::unique_ptr<Call>> replay =
      RetainedPush(*call->partition, from);
  if (!replay.ok()) return replay.status();
  std::vector<Resend> completed;
  {
    MutexLock lock(&mu_);
    if (!replay_noticed_) {
      replay_noticed_ = true;
      std::fprintf(stderr,
                   "morse-worker %u: %s restarted from its checkpoint at step "
                   "%lld; replaying "
                   "steps %lld..%lld\n",
                   client_->rank_,
                   client_->transport_->address(call->partition->shard).c_str(),
                   static_cast<long long>(from), static_cast<long long>(from),
                   static_cast<long long>(until - 1));
    }
    caught_up_[id] = true;
    completed = NoteRestart(call->partition->shard, from);
  }
  if (call->then != nullptr)
    call = std::move(call->then);  // a replay refused again
  (*replay)->then = std::move(call);
  Issue(*std::move(replay));
  for (const Resend& r : completed) ReplayCompleted(*r.partition, from, r.last);
  return absl::OkStatus();
}

std::vector<StepExchange::Resend> StepExchange::NoteRestart(uint32_t shard,
                                                            int64_t from) {
  if (restarted_from_[shard] < 0 || from < restarted_from_[shard])
    restarted_from_[shard] = from;
  std::vector<Resend> out;
  for (const compress::Partition* p : completed_) {
    if (p->shard != shard || caught_up_[p->id]) continue;
    caught_up_[p->id] = true;
    ++in_flight_;
    out.push_back({p, step_});
  }
  if (from < step_) {
    for (const compress::Partition& p : client_->layout_.partitions()) {
      if (p.shard != shard || sent_[p.id] || replayed_ahead_[p.id]) continue;
      replayed_ahead_[p.id] = true;
      ++in_flight_;
      out.push_back({&p, step_ - 1});
    }
  }
  return out;
}

void StepExchange::CatchUp(uint32_t shard, int64_t from) {
  std::vector<Resend> again;
  {
    MutexLock lock(&mu_);
    again = NoteRestart(shard, from);
  }
  for (const Resend& r : again) ReplayCompleted(*r.partition, from, r.last);
}

void StepExchange::ProbeShards() {
  const uint32_t shards = client_->transport_->shards();
  {
    MutexLock lock(&mu_);
    in_flight_ += shards;  // the probes' callbacks use this exchange
  }
  for (uint32_t s = 0; s < shards; ++s) {
    struct Probe {
      v1::ShardInfoRequest request;
      v1::ShardInfo info;
    };
    auto probe = std::make_shared<Probe>();
    client_->transport_->GetShardInfo(
        s, probe->request, &probe->info,
        client_->Options(client_->job_.rpc_timeout_seconds),
        [this, s, probe](absl::Status status) {
          // This worker has every reply of the steps before this one, so a
          // shard that has not completed them restarted from a checkpoint
          // and needs this worker's pushes since.
          if (status.ok() && probe->info.initialized()) {
            const int64_t from = compress::NextExchange(
                client_->job_.algorithm, probe->info.completed_steps());
            if (from < step_) CatchUp(s, from);
          }
          MutexLock lock(&mu_);
          --in_flight_;
        });
  }
}

void StepExchange::ReplayCompleted(const compress::Partition& partition,
                                   int64_t from, int64_t last) {
  absl::StatusOr<std::unique_ptr<Call>> replay = RetainedPush(partition, from);
  if (!replay.ok()) return Fail(partition, replay.status());
  (*replay)->replay_last = last;
  Issue(*std::move(replay));
}

void StepExchange::OnDone(Call* raw, const absl::Status& status) {
  std::unique_ptr<Call> done(raw);
  const double recovery = client_->job_.recovery_timeout_seconds;
  // A push still waiting for a stalled worker when its own deadline passed
  // is re-sent too (the shard keeps the step up to the recovery timeout).
  const bool waited_out =
      status.code() == absl::StatusCode::kDeadlineExceeded &&
      !status.GetPayload(proto::kStepExpiredKey).has_value();
  if (!status.ok() && (Retryable(status) || waited_out)) {
    if (done->first_failure == absl::InfiniteFuture())
      done->first_failure = absl::Now();
    const double down = Since(done->first_failure);
    if (status.GetPayload(proto::kNeedsJoinKey).has_value())
      client_->Rejoin(done->partition->shard);
    if (down < recovery) {
      {
        MutexLock lock(&mu_);
        ++traffic_.retries;
        if (down > 1.0 && absl::Now() - last_notice_ > absl::Seconds(5)) {
          last_notice_ = absl::Now();
          std::fprintf(
              stderr,
              "morse-worker %u: %s unavailable for %.0f s at step %lld (%s); "
              "retrying up to "
              "%.0f s (timeouts.recovery_seconds)\n",
              client_->rank_,
              client_->transport_->address(done->partition->shard).c_str(),
              down, static_cast<long long>(step_),
              std::string(status.message()).c_str(), recovery);
        }
      }
      const uint32_t shard = done->partition->shard;
      RetryLater(std::move(done));
      if (client_->job_.replay_steps >
          0) {  // else nothing is retained: no shard recovery
        CatchUp(shard, step_);
        ProbeShards();
      }
      return;
    }
    return Fail(*done->partition,
                absl::UnavailableError(
                    absl::StrCat("unavailable for ", static_cast<int>(down),
                                 " s (timeouts.recovery_seconds = ", recovery,
                                 "): ", status.message())));
  }
  if (status.code() == absl::StatusCode::kAborted) {
    const std::optional<int64_t> next = proto::NextStep(status);
    if (next.has_value() && *next < done->request.step() &&
        client_->job_.elastic() && !done->replay &&
        client_->JoinedAfter(*next)) {
      // An elastic job's shard restarted from before this worker joined
      // (design.md 4, "Membership"): the others' re-sends say those steps
      // went without it. Push again once the shard has caught up with
      // them, for up to recovery_seconds.
      if (done->first_failure == absl::InfiniteFuture())
        done->first_failure = absl::Now();
      if (Since(done->first_failure) < client_->job_.recovery_timeout_seconds) {
        ++done->attempt;
        RetryLater(std::move(done));
        return;
      }
    }
  }
  done->first_failure = absl::InfiniteFuture();
  if (status.code() == absl::StatusCode::kAborted) {
    const std::optional<int64_t> next = proto::NextStep(status);
    if (next.has_value() && *next < done->request.step()) {
      const compress::Partition* partition = done->partition;
      if (absl::Status s = StartReplay(std::move(done), *next); !s.ok())
        Fail(*partition, s);
      return;
    }
  }
  if (done->replay) {  // a replayed push
    const std::optional<int64_t> accepts = proto::NextStep(status);
    if (status.code() == absl::StatusCode::kFailedPrecondition &&
        accepts.has_value() && *accepts > done->request.step()) {
      // The shard restarted again, from a checkpoint past this step: no one
      // needs it replayed any more. Go on with the refused push, if any.
      std::unique_ptr<Call> then = std::move(done->then);
      if (then != nullptr) return Issue(std::move(then));
      MutexLock lock(&mu_);
      --in_flight_;
      return;
    }
    absl::Status result = status;
    if (result.ok() &&
        compress::BytesHash(done->reply.payload()) != done->expected_hash) {
      result = absl::InternalError(
          absl::StrCat("step ", done->request.step(),
                       " replayed on the restarted shard gave another reply "
                       "than before it restarted; its checkpoint does not "
                       "match the workers"));
    }
    if (!result.ok()) return Fail(*done->partition, result);
    // The step after it that pushed (zero_one_adam's local steps push
    // nothing).
    const int64_t next = compress::NextExchange(client_->job_.algorithm,
                                                done->request.step() + 1);
    if (done->then == nullptr) {  // ReplayCompleted's: on through replay_last
      if (next > done->replay_last) {
        MutexLock lock(&mu_);
        --in_flight_;
        return;
      }
      absl::StatusOr<std::unique_ptr<Call>> replay =
          RetainedPush(*done->partition, next);
      if (!replay.ok()) return Fail(*done->partition, replay.status());
      (*replay)->replay_last = done->replay_last;
      return Issue(*std::move(replay));
    }
    std::unique_ptr<Call> then = std::move(done->then);
    if (next == then->request.step()) return Issue(std::move(then));
    if (absl::Status s = StartReplay(std::move(then), next); !s.ok())
      Fail(*done->partition, s);
    return;
  }
  if (pool_ != nullptr) {
    // Decoding and applying the reply is the worker's work of the step:
    // on the compute pool, off gRPC's thread.
    pool_->Schedule([this, done = std::move(done), status]() mutable {
      Deliver(std::move(done), status);
    });
    return;
  }
  Deliver(std::move(done), status);
}

void StepExchange::Deliver(std::unique_ptr<Call> done,
                           const absl::Status& status) {
  absl::Status result = status;
  const absl::Time start = absl::Now();
  if (done->issued_us >= 0 && !done->replay) {
    // From the push leaving to its reply being here: the wire both ways
    // and the shard's wait for every worker.
    trace::Complete("round trip", done->issued_us, step_, done->partition->id);
  }
  if (result.ok()) {
    result =
        apply_(*done->partition, done->reply.payload(),
               done->reply.has_grad_sum_of_squares()
                   ? std::optional<double>(done->reply.grad_sum_of_squares())
                   : std::nullopt);
  }
  const double apply_seconds = Since(start);
  const compress::Partition* partition = done->partition;
  const size_t bytes_down = done->reply.payload().size();
  std::string buffers = partition->id == 0
                            ? std::move(*done->reply.mutable_buffers())
                            : std::string();
  std::vector<uint32_t> absent(done->reply.absent().begin(),
                               done->reply.absent().end());
  if (result.ok() && client_->job_.replay_steps > 0) {
    // Re-sent only to a shard that restarted: with the step's membership.
    done->request.set_replayed(true);
    for (uint32_t rank : absent) done->request.add_replay_absent(rank);
    client_->Retain(std::move(done->request),
                    compress::BytesHash(done->reply.payload()));
  }
  done.reset();
  int64_t restarted_from = -1;
  {
    MutexLock lock(&mu_);
    if (result.ok() && !caught_up_[partition->id]) {
      completed_.push_back(partition);
      // A reply from the shard as it was before a restart this step has
      // already seen: the restarted shard needs this push replayed too.
      if (restarted_from_[partition->shard] >= 0) {
        restarted_from = restarted_from_[partition->shard];
        caught_up_[partition->id] = true;
        ++in_flight_;
      }
    }
  }
  if (restarted_from >= 0) ReplayCompleted(*partition, restarted_from, step_);
  MutexLock lock(&mu_);
  if (!result.ok() && error_.ok()) {
    error_ = absl::Status(
        result.code(),
        absl::StrCat("partition ", partition->id, " of step ", step_, " on ",
                     client_->transport_->address(partition->shard), ": ",
                     result.message()));
  }
  traffic_.payload_down += bytes_down;
  if (result.ok() && partition->id == 0) received_buffers_ = std::move(buffers);
  if (result.ok() && !absent.empty())
    absent_[partition->id] = std::move(absent);
  traffic_.apply_seconds += apply_seconds;
  --in_flight_;
}

absl::Status StepExchange::Send(const compress::Partition& partition,
                                const Encode& encode) {
  auto call = std::make_unique<Call>();
  call->partition = &partition;
  call->request.set_step(step_);
  call->request.set_rank(client_->rank_);
  call->request.set_partition(partition.id);
  call->request.set_layout_fingerprint(client_->layout_.fingerprint());
  call->request.set_codec(static_cast<v1::Codec>(wire_codec_));
  if (extras_.hyper.has_value()) {
    call->request.set_lr(extras_.hyper->lr);
    call->request.set_weight_decay(extras_.hyper->weight_decay);
  }
  if (partition.id == 0 && !extras_.buffers.empty()) {
    call->request.set_buffers(std::move(extras_.buffers));
  }
  for (double value : extras_.previous_commit)
    call->request.add_previous_commit(value);
  if (extras_.previous_clip_max_norm.has_value()) {
    call->request.set_previous_clip_max_norm(*extras_.previous_clip_max_norm);
  }
  call->request.set_workers_clip(extras_.workers_clip);
  if (extras_.previous_grad_sum_of_squares.has_value()) {
    call->request.set_previous_grad_sum_of_squares(
        *extras_.previous_grad_sum_of_squares);
  }
  if (pool_ != nullptr && parallel_encode_) {
    // The caller goes on (computing the next partitions' gradient) while
    // the sender waits for a slot and a pool thread encodes and pushes this
    // one; an error shows in Finish.
    MutexLock lock(&mu_);
    if (!error_.ok()) return error_;
    queue_.push_back({std::move(call), encode});
    if (!sender_.joinable()) sender_ = std::thread([this] { SendQueued(); });
    return absl::OkStatus();
  }
  {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StepExchange::CanSend));
    if (!error_.ok()) return error_;
    ++in_flight_;
    sent_[partition.id] = true;
  }
  return EncodeAndIssue(std::move(call), encode, /*inline_call=*/true);
}

absl::Status StepExchange::EncodeAndIssue(std::unique_ptr<Call> call,
                                          const Encode& encode,
                                          bool inline_call) {
  const absl::Time start = absl::Now();
  absl::Status encoded =
      encode(*call->partition, call->request.mutable_payload());
  {
    MutexLock lock(&mu_);
    const double seconds = Since(start);
    traffic_.encode_seconds += seconds;
    if (inline_call) traffic_.encode_inline_seconds += seconds;
    traffic_.payload_up += call->request.payload().size();
    if (!encoded.ok()) {
      if (error_.ok()) error_ = encoded;
      --in_flight_;
      return encoded;
    }
  }
  Issue(std::move(call));
  return absl::OkStatus();
}

absl::Status StepExchange::Finish(StepTraffic* traffic) {
  MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &StepExchange::Idle));
  if (traffic != nullptr) *traffic = traffic_;
  return error_;
}

}  // namespace morse::worker
