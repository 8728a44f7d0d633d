#include "worker/shard_recovery.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "absl/strings/str_cat.h"
#include "compress/bytes_hash.h"
#include "compress/step_plan.h"
#include "proto/wire.h"
#include "worker/client.h"
#include "worker/rpc_status.h"

namespace morse::worker {

ShardRecovery::ShardRecovery(PushClient* client, int64_t step,
                             ExchangeSide* exchange)
    : client_(client),
      step_(step),
      exchange_(exchange),
      restarted_from_(client->transport_->shards(), -1),
      caught_up_(client->layout_.partitions().size(), false),
      sent_(client->layout_.partitions().size(), false),
      replayed_ahead_(client->layout_.partitions().size(), false) {}

ShardRecovery::~ShardRecovery() { Wait(); }

void ShardRecovery::Wait() {
  MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &ShardRecovery::Idle));
}

uint32_t ShardRecovery::retries() const {
  MutexLock lock(&mu_);
  return retries_;
}

void ShardRecovery::Sending(uint32_t id) {
  MutexLock lock(&mu_);
  sent_[id] = true;
}

absl::StatusOr<bool> ShardRecovery::CatchUpBetweenSteps(PushClient* client,
                                                        int64_t step) {
  const proto::JobSpec& job = client->job_;
  if (job.replay_steps == 0) return false;
  const uint32_t shards = client->transport_->shards();
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job.recovery_timeout_seconds);
  absl::Duration pause = absl::Milliseconds(5);
  // Where each shard is; a restarted one gets this worker's Join first (an
  // external job's shard learns the model's size, then reads its
  // checkpoint), and one still starting is asked again.
  std::vector<int64_t> from(shards, step);
  for (uint32_t s = 0; s < shards; ++s) {
    for (;;) {
      v1::ShardInfo info;
      absl::Status status =
          worker::Wait(&Transport::GetShardInfo, *client->transport_, s,
                       v1::ShardInfoRequest(), &info,
                       client->Options(job.rpc_timeout_seconds));
      if (status.ok() && info.initialized()) {
        from[s] = compress::NextExchange(job.algorithm, info.completed_steps());
        break;
      }
      if (status.ok()) client->Rejoin(s);
      if (!status.ok() && !Retryable(status)) {
        return RpcError(status, client->transport_->address(s));
      }
      if (absl::Now() > deadline) {
        return absl::UnavailableError(absl::StrCat(
            client->transport_->address(s),
            " did not come back with its model within ",
            job.recovery_timeout_seconds, " s (timeouts.recovery_seconds)",
            status.ok() ? "" : absl::StrCat(": ", status.message())));
      }
      absl::SleepFor(pause);
      pause = std::min(2 * pause, absl::Milliseconds(200));
    }
  }
  if (std::all_of(from.begin(), from.end(),
                  [step](int64_t f) { return f >= step; })) {
    return false;
  }
  // The replays, as a step's exchange would send them (retried while the
  // shard is unreachable, refused again when it restarts again); the first
  // failure is the call's.
  class Replays : public ExchangeSide {
   public:
    explicit Replays(PushClient* client) : client_(client) {}
    void Issue(std::unique_ptr<PushCall> call) override {
      ++call->attempt;
      PushCall* raw = call.release();
      client_->transport_->Push(
          raw->partition->shard, raw->request, &raw->reply,
          client_->Options(client_->job_.rpc_timeout_seconds,
                           raw->partition->id),
          [this, raw](absl::Status status) {
            // Every call here is a replay, which recovery ends itself
            // (Done); one handed back would be a push, which none is.
            std::unique_ptr<PushCall> left =
                recovery_->OnAnswer(std::unique_ptr<PushCall>(raw), status);
            if (left != nullptr) {
              recovery_->Fail(
                  *left->partition,
                  absl::InternalError("a replay came back as a push"),
                  /*exchange_owns=*/false);
            }
          });
    }
    void Fail(const compress::Partition& partition, absl::Status status,
              bool) override {
      MutexLock lock(&mu_);
      if (error_.ok()) {
        error_ = absl::Status(
            status.code(),
            absl::StrCat("replaying partition ", partition.id, " to ",
                         client_->transport_->address(partition.shard), ": ",
                         status.message()));
      }
    }
    absl::Status error() const {
      MutexLock lock(&mu_);
      return error_;
    }
    ShardRecovery* recovery_ = nullptr;

   private:
    PushClient* const client_;
    mutable Mutex mu_;
    absl::Status error_ ABSL_GUARDED_BY(mu_);
  };
  Replays replays(client);
  {
    ShardRecovery recovery(client, step, &replays);
    replays.recovery_ = &recovery;
    for (uint32_t s = 0; s < shards; ++s) {
      if (from[s] >= step) continue;
      std::fprintf(
          stderr,
          "morse-worker %u: %s restarted from its checkpoint at step "
          "%lld; replaying steps %lld..%lld before step %lld\n",
          client->rank_, client->transport_->address(s).c_str(),
          static_cast<long long>(from[s]), static_cast<long long>(from[s]),
          static_cast<long long>(step - 1), static_cast<long long>(step));
      recovery.CatchUp(s, from[s]);
    }
  }  // waits for every replay
  if (absl::Status s = replays.error(); !s.ok()) return s;
  return true;
}

void ShardRecovery::Done() {
  MutexLock lock(&mu_);
  --pending_;
}

void ShardRecovery::Fail(const compress::Partition& partition,
                         absl::Status status, bool exchange_owns) {
  exchange_->Fail(partition, std::move(status), exchange_owns);
  if (!exchange_owns) Done();
}

void ShardRecovery::Fail(const PushCall& call, absl::Status status) {
  Fail(*call.partition, std::move(status), call.exchange_owns);
}

void ShardRecovery::RetryLater(std::unique_ptr<PushCall> call) {
  const absl::Duration backoff =
      absl::Milliseconds(std::min(50 << std::min(call->attempt, 5), 1000));
  // On the client's timer thread, never sleeping on the transport's.
  client_->timer_.After(backoff, [this, raw = call.release()] {
    exchange_->Issue(std::unique_ptr<PushCall>(raw));
  });
}

absl::StatusOr<std::unique_ptr<PushCall>> ShardRecovery::RetainedPush(
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
  auto replay = std::make_unique<PushCall>();
  replay->partition = &partition;
  replay->request = std::move(retained->request);
  replay->expected_hash = retained->reply_hash;
  replay->replay = true;
  return replay;
}

absl::Status ShardRecovery::StartReplay(std::unique_ptr<PushCall> call,
                                        int64_t from) {
  const int64_t until =
      call->request.step();  // replay [from, until), then call
  const uint32_t id = call->partition->id;
  absl::StatusOr<std::unique_ptr<PushCall>> replay =
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
  (*replay)->exchange_owns = call->exchange_owns;
  (*replay)->then = std::move(call);
  exchange_->Issue(*std::move(replay));
  for (const Resend& r : completed) ReplayCompleted(*r.partition, from, r.last);
  return absl::OkStatus();
}

std::vector<ShardRecovery::Resend> ShardRecovery::NoteRestart(uint32_t shard,
                                                              int64_t from) {
  if (restarted_from_[shard] < 0 || from < restarted_from_[shard])
    restarted_from_[shard] = from;
  std::vector<Resend> out;
  for (const compress::Partition* p : completed_) {
    if (p->shard != shard || caught_up_[p->id]) continue;
    caught_up_[p->id] = true;
    ++pending_;
    out.push_back({p, step_});
  }
  if (from < step_) {
    for (const compress::Partition& p : client_->layout_.partitions()) {
      if (p.shard != shard || sent_[p.id] || replayed_ahead_[p.id]) continue;
      replayed_ahead_[p.id] = true;
      ++pending_;
      out.push_back({&p, step_ - 1});
    }
  }
  return out;
}

void ShardRecovery::CatchUp(uint32_t shard, int64_t from) {
  std::vector<Resend> again;
  {
    MutexLock lock(&mu_);
    again = NoteRestart(shard, from);
  }
  for (const Resend& r : again) ReplayCompleted(*r.partition, from, r.last);
}

void ShardRecovery::ProbeShards() {
  const uint32_t shards = client_->transport_->shards();
  {
    MutexLock lock(&mu_);
    pending_ += shards;  // the probes' callbacks use this object
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
          Done();
        });
  }
}

void ShardRecovery::ReplayCompleted(const compress::Partition& partition,
                                    int64_t from, int64_t last) {
  absl::StatusOr<std::unique_ptr<PushCall>> replay =
      RetainedPush(partition, from);
  if (!replay.ok()) return Fail(partition, replay.status(), false);
  (*replay)->replay_last = last;
  (*replay)->exchange_owns = false;
  exchange_->Issue(*std::move(replay));
}

std::unique_ptr<PushCall> ShardRecovery::OnAnswer(
    std::unique_ptr<PushCall> done, const absl::Status& status) {
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
        ++retries_;
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
      return nullptr;
    }
    Fail(*done, absl::UnavailableError(
                    absl::StrCat("unavailable for ", static_cast<int>(down),
                                 " s (timeouts.recovery_seconds = ", recovery,
                                 "): ", status.message())));
    return nullptr;
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
        return nullptr;
      }
    }
  }
  done->first_failure = absl::InfiniteFuture();
  if (status.code() == absl::StatusCode::kAborted) {
    const std::optional<int64_t> next = proto::NextStep(status);
    if (next.has_value() && *next < done->request.step()) {
      const compress::Partition* partition = done->partition;
      const bool exchange_owns = done->exchange_owns;
      if (absl::Status s = StartReplay(std::move(done), *next); !s.ok())
        Fail(*partition, s, exchange_owns);
      return nullptr;
    }
  }
  if (done->replay) {
    OnReplayAnswer(std::move(done), status);
    return nullptr;
  }
  return done;
}

void ShardRecovery::OnReplayAnswer(std::unique_ptr<PushCall> done,
                                   const absl::Status& status) {
  const std::optional<int64_t> accepts = proto::NextStep(status);
  if (status.code() == absl::StatusCode::kFailedPrecondition &&
      accepts.has_value() && *accepts > done->request.step()) {
    // The shard restarted again, from a checkpoint past this step: no one
    // needs it replayed any more. Go on with the refused push, if any.
    std::unique_ptr<PushCall> then = std::move(done->then);
    if (then != nullptr) return exchange_->Issue(std::move(then));
    return Done();
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
  if (!result.ok()) return Fail(*done, result);
  // The step after it that pushed (zero_one_adam's local steps push
  // nothing).
  const int64_t next =
      compress::NextExchange(client_->job_.algorithm, done->request.step() + 1);
  if (done->then == nullptr) {  // ReplayCompleted's: on through replay_last
    if (next > done->replay_last) return Done();
    absl::StatusOr<std::unique_ptr<PushCall>> replay =
        RetainedPush(*done->partition, next);
    if (!replay.ok()) return Fail(*done, replay.status());
    (*replay)->replay_last = done->replay_last;
    (*replay)->exchange_owns = false;
    return exchange_->Issue(*std::move(replay));
  }
  std::unique_ptr<PushCall> then = std::move(done->then);
  if (next == then->request.step()) return exchange_->Issue(std::move(then));
  const bool exchange_owns = then->exchange_owns;
  if (absl::Status s = StartReplay(std::move(then), next); !s.ok())
    Fail(*done->partition, s, exchange_owns);
}

void ShardRecovery::Applied(const compress::Partition& partition,
                            v1::PushRequest request,
                            absl::string_view reply_payload,
                            absl::Span<const uint32_t> absent) {
  if (client_->job_.replay_steps > 0) {
    // Re-sent only to a shard that restarted: with the step's membership.
    request.set_replayed(true);
    for (uint32_t rank : absent) request.add_replay_absent(rank);
    client_->Retain(std::move(request), compress::BytesHash(reply_payload));
  }
  int64_t restarted_from = -1;
  {
    MutexLock lock(&mu_);
    if (caught_up_[partition.id]) return;
    completed_.push_back(&partition);
    // A reply from the shard as it was before a restart this step has
    // already seen: the restarted shard needs this push replayed too.
    if (restarted_from_[partition.shard] >= 0) {
      restarted_from = restarted_from_[partition.shard];
      caught_up_[partition.id] = true;
      ++pending_;
    }
  }
  if (restarted_from >= 0) ReplayCompleted(partition, restarted_from, step_);
}

}  // namespace morse::worker
