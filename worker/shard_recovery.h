// ShardRecovery: what one step's exchange does when a push is not simply
// answered (DESIGN 4). It sits beside StepExchange, which calls it at its
// two ends, as ps-lite's Resender sits beside its van:
//
//   outgoing  Sending(): a partition's push of this step takes its slot in
//             the window;
//   incoming  OnAnswer(): every push's outcome. A reply (or an error that
//             ends the push) goes back to the exchange to apply; anything
//             else is recovery's: an unreachable shard is retried with
//             backoff until timeouts.recovery_seconds, a shard that
//             restarted from its checkpoint is replayed the retained pushes
//             it lost (each recomputed reply checked against the one
//             applied), and a shard that may have restarted is probed and
//             caught up. Applied() then retains the applied push for later
//             replays.
//
// Re-sends of pushes this step already completed are recovery's own calls:
// it counts them (and its probes) and Wait() returns once none is in
// flight. The exchange's own push, when recovery replays older steps
// before it, stays counted by the exchange until it ends, which recovery
// says through ExchangeSide::Fail or by handing it back from OnAnswer.
//
// Locks: the exchange may call Sending() holding its own lock; recovery
// calls the exchange (ExchangeSide) only without holding its own.
#ifndef MORSE_WORKER_SHARD_RECOVERY_H_
#define MORSE_WORKER_SHARD_RECOVERY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "compress/layout.h"
#include "compress/sync.h"
#include "proto/morse.pb.h"

namespace morse::worker {

class PushClient;

// One push in flight: the step's own, or a retained one re-sent.
struct PushCall {
  v1::PushRequest request;
  v1::PushReply reply;
  const compress::Partition* partition = nullptr;
  absl::Time first_failure = absl::InfiniteFuture();  // of the current outage
  int attempt = 0;
  int64_t issued_us = -1;  // the trace's clock, when tracing
  // A replay: this call re-sends a retained push whose reply must hash to
  // `expected_hash`; `then` is the refused push to send once caught up, or
  // null for re-sends of a completed partition, which go on through
  // `replay_last`.
  bool replay = false;
  std::unique_ptr<PushCall> then;
  uint64_t expected_hash = 0;
  int64_t replay_last = -1;
  // Counted by the exchange (this step's push, and the replays chained
  // before it), not by recovery.
  bool exchange_owns = true;
};

// What recovery calls on the exchange it serves.
class ExchangeSide {
 public:
  virtual ~ExchangeSide() = default;
  // Sends `call`; its outcome comes back through ShardRecovery::OnAnswer.
  virtual void Issue(std::unique_ptr<PushCall> call) = 0;
  // The step fails with `status` (its first failure is what Finish
  // returns); `ends_call`: one of the exchange's own pushes ends with it.
  virtual void Fail(const compress::Partition& partition, absl::Status status,
                    bool ends_call) = 0;
};

class ShardRecovery {
 public:
  ShardRecovery(PushClient* client, int64_t step, ExchangeSide* exchange);
  ~ShardRecovery();  // waits for its calls in flight
  ShardRecovery(const ShardRecovery&) = delete;
  ShardRecovery& operator=(const ShardRecovery&) = delete;

  // Partition `id`'s push of this step has taken its slot (it will be
  // sent; a restart noticed from now on replays no step before it ahead).
  void Sending(uint32_t id);
  // The outcome of `call`: the call handed back when the exchange is to
  // apply it (a reply, or an error that ends the step); null when recovery
  // has taken it on.
  std::unique_ptr<PushCall> OnAnswer(std::unique_ptr<PushCall> call,
                                     const absl::Status& status);
  // The reply of this step's push of `partition` was applied: the push is
  // retained for replays (with the ranks its reply left out), and, when
  // its shard has restarted since, re-sent to it.
  void Applied(const compress::Partition& partition, v1::PushRequest request,
               absl::string_view reply_payload,
               absl::Span<const uint32_t> absent);
  // Waits until none of recovery's own calls is in flight.
  void Wait();
  // Pushes retried so far (unreachable shards, elastic re-pushes).
  uint32_t retries() const;

  // Between steps, with no exchange in flight: brings every shard that
  // restarted from its checkpoint up to `step`, this worker's next step,
  // as the step's first push to it would. A shard that lost its model is
  // joined again; one behind this worker is replayed this worker's
  // retained pushes of the steps it lost (their replies checked against
  // the ones applied). What a worker asks of the shards' model between
  // steps needs every shard at one step (Session::HoldsShardsModel,
  // ReloadModel, ServerError), and a restarted shard moves on only with
  // the workers' replays: a partition's replay is answered once every
  // worker's is in, this call's or another worker's next step's. Gives
  // up after timeouts.recovery_seconds. Returns whether it replayed
  // anything: false at once where nothing is retained
  // (checkpoint.replay_steps 0) or no shard is behind. A replayed last
  // step then waits for its commit (the caller's to send).
  static absl::StatusOr<bool> CatchUpBetweenSteps(PushClient* client,
                                                  int64_t step);

 private:
  void RetryLater(std::unique_ptr<PushCall> call);
  // Ends a call of `partition` with an error: the exchange's push
  // (`exchange_owns`), or one of recovery's.
  void Fail(const compress::Partition& partition, absl::Status status,
            bool exchange_owns);
  void Fail(const PushCall& call, absl::Status status);
  // One of recovery's calls ended.
  void Done();
  // Starts re-sending retained pushes of `call`'s partition from step
  // `from` on, then `call` itself; an error if they are not retained.
  absl::Status StartReplay(std::unique_ptr<PushCall> call, int64_t from);
  // A replay of this worker's retained push of `partition` at `step`;
  // FAILED_PRECONDITION, saying why, when it is no longer retained.
  absl::StatusOr<std::unique_ptr<PushCall>> RetainedPush(
      const compress::Partition& partition, int64_t step);
  // A replayed push's outcome (OnAnswer's, for call->replay).
  void OnReplayAnswer(std::unique_ptr<PushCall> done,
                      const absl::Status& status);
  // A partition whose reply of this step came from a shard that has since
  // restarted from its checkpoint at step `from`: its retained pushes of
  // [from, last] are re-sent (replies checked, not applied), because the
  // restarted shard needs them to answer the workers still waiting for
  // that reply. Called with the re-send counted in pending_.
  void ReplayCompleted(const compress::Partition& partition, int64_t from,
                       int64_t last);
  // Replays to `shard`, restarted (or perhaps restarted) from a checkpoint
  // at step `from`, what it may need of this worker (NoteRestart).
  //
  // Called with `from` = this step when a push of this step to `shard` goes
  // unanswered (unreachable, or past its deadline): the shard may have
  // restarted from a checkpoint of this step and lost replies it had sent,
  // and then it waits for this worker's pushes of the partitions this
  // worker already has, while this worker waits for the others'. A shard
  // that did not restart answers the re-sent pushes from the reply it
  // keeps (checked, not applied); the cost is that every partition of that
  // shard this step is sent twice from then on.
  void CatchUp(uint32_t shard, int64_t from);
  // Also on an unanswered push: asks every shard how far it is. One behind
  // this worker's step restarted from a checkpoint, and this worker may be
  // the one it waits for while this worker's window is held by pushes to
  // other shards that wait for workers stuck on it: CatchUp at once.
  void ProbeShards();
  // Marks the restart of `shard` at `from` and returns what to replay, each
  // now counted in pending_: the partitions this step already completed
  // there (through this step), and, when `from` is earlier than this step,
  // those this step has not sent yet (through the step before; the shard
  // may need them to answer the pushes that hold the window).
  struct Resend {
    const compress::Partition* partition;
    int64_t last;  // replay [from, last]
  };
  std::vector<Resend> NoteRestart(uint32_t shard, int64_t from)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; }

  PushClient* const client_;
  const int64_t step_;
  ExchangeSide* const exchange_;
  mutable Mutex mu_;
  uint32_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // its calls and probes
  uint32_t retries_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_notice_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool replay_noticed_ ABSL_GUARDED_BY(mu_) = false;
  // Per shard: the step it restarted from during this exchange (-1: none).
  std::vector<int64_t> restarted_from_ ABSL_GUARDED_BY(mu_);
  // Partitions whose reply came without a replay, and those caught up with
  // their shard's restart (replayed, or re-sent by ReplayCompleted).
  std::vector<const compress::Partition*> completed_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> caught_up_ ABSL_GUARDED_BY(mu_);
  // Partitions whose push of this step has taken its slot; those replayed
  // before it did (NoteRestart).
  std::vector<bool> sent_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> replayed_ahead_ ABSL_GUARDED_BY(mu_);
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_SHARD_RECOVERY_H_
