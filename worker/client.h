// PushClient: a worker's calls to every shard of the job and the
// pipelined exchange of one step (DESIGN 1), over a Transport
// (transport/transport.h): gRPC in the daemons, where each shard gets
// `channels_per_shard` channels (separate TCP connections; partitions are
// spread over them round-robin), or in-process in tests. A step's exchange is a
// StepExchange: it encodes partitions on the calling thread and keeps up to
// `window` pushes in flight; a reply is applied on a gRPC thread as soon as it
// arrives, so encoding, transfer and decoding overlap. Pushes that fail with
// UNAVAILABLE (server not up yet, or restarting) are retried with
// exponential backoff on a timer (never sleeping on a gRPC thread) until
// timeouts.recovery_seconds; pushes are idempotent on the server, so a retry
// is safe.
//
// Shard recovery (DESIGN 4): the client keeps each completed push of the
// last checkpoint.replay_steps steps with a hash of its reply. A shard that
// restarted from its checkpoint is behind: it answers a push with ABORTED
// and the step it accepts, and the client re-sends its retained pushes from
// that step on, checks that every recomputed reply is the one it applied
// before, then sends the push that was refused. An external job's shard
// that restarted without its model gets this worker's Join again first.
#ifndef MORSE_WORKER_CLIENT_H_
#define MORSE_WORKER_CLIENT_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "compress/compute_pool.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "proto/morse.pb.h"
#include "proto/security.h"
#include "worker/timer.h"
#include "worker/transport/transport.h"

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
  std::vector<double> previous_lamb_commit;
  // The workers clip this step's averaged gradient by a max_norm they
  // commit after it (morse.proto PushRequest.workers_clip).
  bool workers_clip = false;
};

// One step's exchange, sent partition by partition: Send waits for a slot
// in the window, then encodes the partition and pushes it, on the calling
// thread, or (parallel_encode, with the client's compute pool) queues it
// and goes on while the exchange's sender thread waits for the slot and a
// pool thread encodes and pushes it; its reply is applied when it lands, on the
// pool if the client has one, else on a gRPC thread. Finish waits for every
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

  // parallel_encode: `encode` may run on the compute pool, concurrently
  // for different partitions (the host engine; not a GPU's).
  StepExchange(PushClient* client, int64_t step, compress::CodecKind up,
               Apply apply, StepExtras extras = {},
               bool parallel_encode = false);
  ~StepExchange();
  StepExchange(const StepExchange&) = delete;
  StepExchange& operator=(const StepExchange&) = delete;

  // Returns the first error of the step so far (then nothing is sent).
  absl::Status Send(const compress::Partition& partition, const Encode& encode);
  absl::Status Finish(StepTraffic* traffic);
  // The module buffers that came with partition 0's reply (empty if none).
  std::string TakeReceivedBuffers();

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
  const int64_t step_;
  const int wire_codec_;
  const bool parallel_encode_;
  Apply apply_;
  StepExtras extras_;  // buffers are moved into partition 0's push
  Mutex mu_;
  std::string received_buffers_ ABSL_GUARDED_BY(mu_);
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

class PushClient {
 public:
  // `servers[s]` is shard s's host:port. Creates channels with the
  // credentials of `security` (INVALID_ARGUMENT if they break the policy of
  // proto/security.h); connects lazily. compute_threads > 0: a compute pool
  // of that many threads encodes and applies the steps' partitions
  // (StepExchange); 0: none.
  static absl::StatusOr<std::unique_ptr<PushClient>> Create(
      const proto::JobSpec& job, const compress::Layout& layout,
      std::vector<std::string> servers, uint32_t rank,
      const proto::SecurityOptions& security, int compute_threads = 0);
  // The same over any transport (tests: tests/inproc); `tls` only words
  // the connect timeout's error.
  static absl::StatusOr<std::unique_ptr<PushClient>> Create(
      const proto::JobSpec& job, const compress::Layout& layout,
      std::unique_ptr<Transport> transport, uint32_t rank,
      int compute_threads = 0, bool tls = false);

  // Waits, retrying with backoff up to the connect timeout, until every shard
  // answers and has this job's layout. FAILED_PRECONDITION on a layout or
  // shard-index mismatch; DEADLINE_EXCEEDED naming the shards that never
  // answered.
  absl::Status WaitForShards();

  // Joins every shard with this worker's job config (see morse.proto Join):
  // FAILED_PRECONDITION saying how the job differs from a shard's.
  absl::Status Join();

  // Waits up to the connect timeout until all N workers have joined every
  // shard; FAILED_PRECONDITION saying how many have.
  absl::Status WaitAllJoined();

  // Rank 0: uploads x0 partition by partition.
  absl::Status UploadInitialParameters(absl::Span<const float> x0);

  // Waits until every shard has all its initial parameters.
  absl::Status WaitInitialized();

  // Downloads the shards' mirror of x, m and v (and the optimizer's own
  // arrays: onebit_lamb's v' and layer state) into the replica of the whole
  // model and returns the steps completed, which must be the same on every
  // partition (FAILED_PRECONDITION otherwise).
  absl::StatusOr<int64_t> FetchModel(compress::Replica& replica);
  // The payload FetchModel's and FetchServerError's FAILED_PRECONDITION
  // carries when partitions are at different steps (a restore of a saved
  // run still going partition by partition, or shards restarted apart).
  static constexpr char kMixedStepsKey[] = "morse-mixed-steps";

  // The shards' error buffers (dim floats) after the steps they have
  // completed, which it returns (the same on every partition, else
  // FAILED_PRECONDITION); x, m and v stay on the shards.
  absl::StatusOr<int64_t> FetchServerError(absl::Span<float> server_error);

  // Rank 0: restores a saved run on every shard before the first step
  // (ShardCore::RestorePartition), partition by partition, with the
  // optimizer's own arrays (compress::Optimizer::State, in order; per
  // element ones over the whole model, the others the same for every
  // partition: onebit_lamb's v' and layer state).
  absl::Status RestoreModel(int64_t step, absl::Span<const float> x,
                            absl::Span<const float> m,
                            absl::Span<const float> v,
                            absl::Span<const float> server_error,
                            absl::Span<const compress::NamedState> own = {});

  // The steps every partition of every shard has completed (the least).
  absl::StatusOr<int64_t> CompletedSteps();

  // Tells every shard that this worker stops the job at `step` because of
  // `reason` (ShardCore::Abort), so the other workers' pushes fail with it
  // at once. Best effort: waits at most a few seconds for all shards and
  // returns the first failure.
  absl::Status Abort(int64_t step, const std::string& reason);

  // Sends step `step`'s sum of squares of the averaged gradient to every
  // shard (ShardCore::Commit) and waits for them all; with the workers'
  // max_norm when the step's pushes said workers_clip.
  absl::Status Commit(int64_t step, double grad_sum_of_squares,
                      std::optional<float> clip_max_norm = std::nullopt);
  // onebit_lamb: step `step`'s layer coefficients and state
  // (compress::Replica::LambStep; ShardCore::CommitLamb), likewise.
  absl::Status CommitLamb(int64_t step, absl::Span<const double> commit);

  // Every shard's info, in shard order.
  absl::StatusOr<std::vector<v1::ShardInfo>> ShardInfos();

  const proto::JobSpec& job() const { return job_; }
  const compress::Layout& layout() const { return layout_; }

  // Pushes retained for replay (steps), and the oldest step retained.
  size_t retained_pushes() const;

 private:
  friend class StepExchange;
  absl::Status SendCommit(int64_t step, double grad_sum_of_squares,
                          std::optional<float> clip_max_norm,
                          absl::Span<const double> lamb);
  using StartCall = std::function<void(
      uint32_t shard, const CallOptions& options, Transport::Done done)>;
  // Starts one call on every shard whose `pending` is true (all, if empty)
  // at once (`start` issues shard s's with `options` and `done`) and waits
  // for all; each shard's outcome (OK for a shard not called).
  std::vector<absl::Status> CallShards(double timeout_seconds,
                                       const std::vector<bool>& pending,
                                       const StartCall& start);
  // CallShards on every shard; the first failure, described as `what` the
  // shard.
  absl::Status OnEveryShard(double timeout_seconds, absl::string_view what,
                            const StartCall& start);
  struct Retained {
    v1::PushRequest request;
    uint64_t reply_hash = 0;
  };
  // Keeps a completed push (its request, moved) and its reply's hash, and
  // drops pushes older than replay_steps before `request.step()`.
  void Retain(v1::PushRequest request, uint64_t reply_hash);
  // A copy of the retained push of (step, partition), if any.
  std::optional<Retained> Find(int64_t step, uint32_t partition) const;
  // Fetches every partition's x, m, v (into `model`, if given) and server
  // error (into `server_error`, if not empty); returns the steps completed,
  // which must be the same on every partition (FAILED_PRECONDITION otherwise).
  struct ModelArrays {
    compress::Replica* replica;  // of the whole model
  };
  absl::StatusOr<int64_t> Fetch(std::optional<ModelArrays> model,
                                absl::Span<float> server_error);
  // Sends this worker's Join to `shard` in the background (once at a time):
  // for an external job's shard that restarted without its model.
  void Rejoin(uint32_t shard);
  PushClient(const proto::JobSpec& job, const compress::Layout& layout,
             std::unique_ptr<Transport> transport, uint32_t rank, bool tls);
  // A call's deadline `seconds` from now, on `lane` (a partition's id).
  CallOptions Options(double seconds, uint32_t lane = 0) const;

  proto::JobSpec job_;
  compress::Layout layout_;
  std::unique_ptr<Transport> transport_;
  uint32_t rank_;
  bool tls_;
  // Retries' backoff (StepExchange::RetryLater); destroyed before the
  // transport.
  Timer timer_;
  mutable Mutex retained_mu_;
  std::map<std::pair<int64_t, uint32_t>, Retained> retained_
      ABSL_GUARDED_BY(retained_mu_);
  std::vector<bool> rejoining_ ABSL_GUARDED_BY(retained_mu_);
  // With compute_threads > 0 (Create): encodes (StepExchange's
  // parallel_encode) and applies replies; destroyed first.
  std::unique_ptr<compress::ComputePool> pool_;

 public:
  // The compute pool (null without one), for the session's own passes over
  // the model between exchanges.
  compress::ComputePool* pool() const { return pool_.get(); }
  // Starts a compute pool of `threads` if the client has none (between
  // steps only).
  void EnsurePool(int threads) {
    if (pool_ == nullptr)
      pool_ = std::make_unique<compress::ComputePool>(threads);
  }
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_CLIENT_H_
