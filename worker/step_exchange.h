// StepExchange: one step's pipelined exchange with every shard (DESIGN 1):
// partitions encoded and pushed through a window, replies applied as they
// land, pushes retried on UNAVAILABLE, and a restarted shard's replay
// (DESIGN 4) from the pushes its PushClient retains. client.h says how it
// fits with the client's other calls.
#ifndef MORSE_WORKER_STEP_EXCHANGE_H_
#define MORSE_WORKER_STEP_EXCHANGE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compress/codec.h"
#include "compress/compute_pool.h"
#include "compress/layout.h"
#include "compress/simulator.h"
#include "compress/sync.h"

namespace morse::worker {

struct StepTraffic {
  uint64_t payload_up = 0;           // payload bytes pushed
  uint64_t payload_down = 0;         // payload bytes received
  double encode_seconds = 0;         // summed over the threads that encoded
  double encode_inline_seconds = 0;  // of which on the calling thread
  double apply_seconds = 0;          // summed over the threads that applied
  uint32_t retries = 0;
};

class PushClient;

// What every push of a step carries besides its payload.
struct StepExtras {
  // The step's learning rate and weight decay (absent: the job's schedule).
  std::optional<compress::StepHyper> hyper;
  // Rank 0's module buffers, sent with its push of partition 0
  // (morse.proto); the reply's are in received_buffers() after Finish.
  std::string buffers;
  // The previous step's sum of squares of the averaged gradient, when that
  // step clipped it (morse.proto Commit).
  std::optional<double> previous_grad_sum_of_squares;
  // With it, when the workers chose that step's max_norm.
  std::optional<float> previous_clip_max_norm;
  // onebit_lamb: the previous step's commit (morse.proto CommitRequest).
  std::vector<double> previous_commit;
  // The workers clip this step's averaged gradient by a max_norm they
  // commit after it (morse.proto PushRequest.workers_clip).
  bool workers_clip = false;
};

// One step's exchange, sent partition by partition: Send waits for a slot
// in the window, then encodes the partition and pushes it, on the calling
// thread, or (parallel_encode, with the session's compute pool) queues it
// and goes on while the exchange's sender thread waits for the slot and a
// pool thread encodes and pushes it; its reply is applied when it lands, on
// the pool if there is one, else on a gRPC thread. Finish waits for every
// sent partition. Sends must come from one thread; the destructor waits for
// anything in flight.
class StepExchange {
 public:
  using Encode = std::function<absl::Status(const compress::Partition&,
                                            std::string* payload)>;
  // `grad_sum_of_squares`: the shard's, when the step clips the averaged
  // gradient (compress::ClipsAverage).
  using Apply = std::function<absl::Status(
      const compress::Partition&, const std::string& reply,
      std::optional<double> grad_sum_of_squares)>;

  // `pool` (null: none) encodes and applies partitions; it outlives the
  // exchange. parallel_encode: `encode` may run on the pool, concurrently
  // for different partitions (the host engine; not a GPU's).
  StepExchange(PushClient* client, compress::ComputePool* pool, int64_t step,
               compress::CodecKind up, Apply apply, StepExtras extras = {},
               bool parallel_encode = false);
  ~StepExchange();
  StepExchange(const StepExchange&) = delete;
  StepExchange& operator=(const StepExchange&) = delete;

  // Returns the first error of the step so far (then nothing is sent).
  absl::Status Send(const compress::Partition& partition, const Encode& encode);
  absl::Status Finish(StepTraffic* traffic);
  // The module buffers that came with partition 0's reply (empty if none).
  std::string TakeReceivedBuffers();
  // The ranks each partition's reply left out of its average (membership,
  // design.md 4, "Membership"), for the partitions whose replies left some out.
  std::map<uint32_t, std::vector<uint32_t>> TakeAbsent();

 private:
  struct Call;
  void Issue(std::unique_ptr<Call> call);
  void OnDone(Call* raw, const absl::Status& status);
  // A reply (or final error) of this step's own push: applies it and
  // counts the partition done.
  void Deliver(std::unique_ptr<Call> done, const absl::Status& status);
  absl::Status EncodeAndIssue(std::unique_ptr<Call> call, const Encode& encode,
                              bool inline_call);
  void RetryLater(std::unique_ptr<Call> call);
  // Starts re-sending retained pushes of `call`'s partition from step
  // `from` on, then `call` itself; an error if they are not retained.
  absl::Status StartReplay(std::unique_ptr<Call> call, int64_t from);
  // A replay of this worker's retained push of `partition` at `step`;
  // FAILED_PRECONDITION, saying why, when it is no longer retained.
  absl::StatusOr<std::unique_ptr<Call>> RetainedPush(
      const compress::Partition& partition, int64_t step);
  // A partition whose reply of this step came from a shard that has since
  // restarted from its checkpoint at step `from`: its retained pushes of
  // [from, step_] are re-sent (replies checked, not applied), because the
  // restarted shard needs them to answer the workers still waiting for
  // that reply. Called with the partition counted in in_flight_.
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
  // now counted in in_flight_: the partitions this step already completed
  // there (through this step), and, when `from` is earlier than this step,
  // those this step has not sent yet (through the step before; the shard
  // may need them to answer the pushes that hold the window).
  struct Resend {
    const compress::Partition* partition;
    int64_t last;  // replay [from, last]
  };
  std::vector<Resend> NoteRestart(uint32_t shard, int64_t from)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(const compress::Partition& partition, absl::Status status);

  PushClient* client_;
  compress::ComputePool* const pool_;
  const int64_t step_;
  const int wire_codec_;
  const bool parallel_encode_;
  Apply apply_;
  StepExtras extras_;  // buffers are moved into partition 0's push
  Mutex mu_;
  std::string received_buffers_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, std::vector<uint32_t>> absent_ ABSL_GUARDED_BY(mu_);
  absl::Time last_notice_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool replay_noticed_ ABSL_GUARDED_BY(mu_) = false;
  // Per shard: the step it restarted from during this exchange (-1: none).
  std::vector<int64_t> restarted_from_ ABSL_GUARDED_BY(mu_);
  // Partitions whose reply came without a replay, and those caught up with
  // their shard's restart (replayed, or re-sent by ReplayCompleted).
  std::vector<const compress::Partition*> completed_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> caught_up_ ABSL_GUARDED_BY(mu_);
  // Partitions whose push of this step has been sent; those replayed
  // before it was (NoteRestart).
  std::vector<bool> sent_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> replayed_ahead_ ABSL_GUARDED_BY(mu_);
  uint32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  StepTraffic traffic_ ABSL_GUARDED_BY(mu_);
  // With the compute pool (parallel_encode), Send queues the partition and
  // the sender thread waits for its slot in the window and hands it to the
  // pool, so that the caller (the training thread; backward()'s hooks on a
  // GPU) never waits for replies. Started by the first queued Send, ended
  // by the destructor once nothing is queued or in flight.
  struct Queued {
    std::unique_ptr<Call> call;
    Encode encode;
  };
  void SendQueued();
  // Await conditions: a slot in the window is free (or the step failed,
  // and nothing more is sent); nothing is queued or in flight.
  bool CanSend() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_STEP_EXCHANGE_H_
