// PushClient: a worker's calls to every shard of the job and the
// pipelined exchange of one step (DESIGN 1), over a Transport
// (transport/transport.h): gRPC in the daemons, where each shard gets
// `channels_per_shard` channels (separate TCP connections; partitions are
// spread over them round-robin), or in-process in tests. A step's exchange is a
// StepExchange (worker/step_exchange.h, over this client): it encodes
// partitions on the calling thread and keeps up to `window` pushes in flight; a
// reply is applied on a gRPC thread as soon as it arrives, so encoding,
// transfer and decoding overlap. Pushes that fail with UNAVAILABLE (server not
// up yet, or restarting) are retried with exponential backoff on a timer (never
// sleeping on a gRPC thread) until timeouts.recovery_seconds; pushes are
// idempotent on the server, so a retry is safe.
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
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "proto/morse.pb.h"
#include "proto/security.h"
#include "worker/timer.h"
#include "worker/transport/transport.h"

namespace morse::worker {

class PushClient {
 public:
  // `servers[s]` is shard s's host:port. Creates channels with the
  // credentials of `security` (INVALID_ARGUMENT if they break the policy of
  // proto/security.h); connects lazily.
  static absl::StatusOr<std::unique_ptr<PushClient>> Create(
      const proto::JobSpec& job, const compress::Layout& layout,
      std::vector<std::string> servers, uint32_t rank,
      const proto::SecurityOptions& security);
  // The same over any transport (tests: tests/inproc); `tls` only words
  // the connect timeout's error.
  static absl::StatusOr<std::unique_ptr<PushClient>> Create(
      const proto::JobSpec& job, const compress::Layout& layout,
      std::unique_ptr<Transport> transport, uint32_t rank, bool tls = false);

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
  // Whether the shards hold `x` (dim floats) as their model's x, asking
  // each partition for its hash (PushRequest.x_hash's) instead of its
  // arrays, and the steps they completed (the same on every partition,
  // else FAILED_PRECONDITION as FetchModel's).
  struct ShardsX {
    int64_t completed_steps = 0;
    bool same = false;
  };
  absl::StatusOr<ShardsX> CompareX(absl::Span<const float> x);
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

  // Rank 0: gives every shard the model's changed x between steps, before
  // step `step` (ShardCore::ReplaceX), partition by partition. A partition
  // still waiting for its last step's commit is asked again, up to
  // timeouts.connect_seconds.
  absl::Status ReplaceX(int64_t step, absl::Span<const float> x);

  // The steps every partition of every shard has completed (the least).
  absl::StatusOr<int64_t> CompletedSteps();

  // Tells every shard that this worker stops the job at `step` because of
  // `reason` (ShardCore::Abort), so the other workers' pushes fail with it
  // at once. Best effort: waits at most a few seconds for all shards and
  // returns the first failure.
  absl::Status Abort(int64_t step, const std::string& reason);

  // Sends step `step`'s commit to every shard (ShardCore::CommitStep) and
  // waits for them all: the averaged gradient's sum of squares when the
  // step clipped it (with the workers' max_norm when its pushes said
  // workers_clip), the optimizer's values when it commits (onebit_lamb:
  // compress::Replica::CommitStep's layer coefficients and state), both in
  // one commit when the step has both; `clip_pieces`, the workers' clip of
  // part of the model (with a max_norm of 0), if any; `amended`, the
  // step's gradient as the workers amended it (the whole model, with a
  // max_norm of 0; Session::AmendAt), if they did: each shard gets one
  // request for each of its partitions, with the partition's part.
  absl::Status Commit(int64_t step, std::optional<double> grad_sum_of_squares,
                      std::optional<float> clip_max_norm,
                      absl::Span<const double> values,
                      absl::Span<const compress::ClipPiece> clip_pieces = {},
                      absl::Span<const float> amended = {});

  // Every shard's info, in shard order.
  absl::StatusOr<std::vector<v1::ShardInfo>> ShardInfos();
  // The same, a call lost with its connection (UNAVAILABLE: a GOAWAY, a
  // shard restarting) asked again every `pause` until `deadline`: the
  // start-up polls' (WaitAllJoined, WaitInitialized).
  absl::StatusOr<std::vector<v1::ShardInfo>> ShardInfosUntil(
      absl::Time deadline, absl::Duration pause);

  const proto::JobSpec& job() const { return job_; }
  const compress::Layout& layout() const { return layout_; }

  // Pushes retained for replay (steps), and the oldest step retained.
  size_t retained_pushes() const;

 private:
  // A RestorePartition request of partition p at `step` from this rank,
  // with p's part of x (RestoreModel adds the rest, ReplaceX its flag).
  v1::PartitionState RestoreRequest(const compress::Partition& p, int64_t step,
                                    absl::Span<const float> x) const;
  friend class StepExchange;
  friend class ShardRecovery;
  using StartCall = std::function<void(
      uint32_t call, const CallOptions& options, Transport::Done done)>;
  // Starts calls 0..count-1 whose `pending` is true (all, if empty) at
  // once (`start` issues call i with `options` and `done`) and waits for
  // all; each call's outcome (OK for one not made).
  std::vector<absl::Status> CallEach(size_t count, double timeout_seconds,
                                     const std::vector<bool>& pending,
                                     const StartCall& start);
  // CallEach with one call on every shard, call s on shard s; the first
  // failure, described as `what` the shard.
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
  // This process completed no push of `step` or before: it joined the job
  // after it (an elastic job's new or restarted worker).
  bool JoinedAfter(int64_t step) const;
  // Fetches every partition's x, m, v (into `model`, if given) and server
  // error (into `server_error`, if not empty), and compares its x's hash
  // with `compare_x`'s (if not empty; *same is whether every partition's
  // matched); returns the steps completed, which must be the same on every
  // partition (FAILED_PRECONDITION otherwise).
  struct ModelArrays {
    compress::Replica* replica;  // of the whole model
  };
  absl::StatusOr<int64_t> Fetch(std::optional<ModelArrays> model,
                                absl::Span<float> server_error,
                                absl::Span<const float> compare_x = {},
                                bool* same = nullptr);
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
  // Retries' backoff (ShardRecovery::RetryLater); destroyed before the
  // transport.
  Timer timer_;
  mutable Mutex retained_mu_;
  std::map<std::pair<int64_t, uint32_t>, Retained> retained_
      ABSL_GUARDED_BY(retained_mu_);
  std::vector<bool> rejoining_ ABSL_GUARDED_BY(retained_mu_);
  // The first step whose push this process retained (INT64_MAX: none yet).
  int64_t first_retained_ ABSL_GUARDED_BY(retained_mu_) = INT64_MAX;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_CLIENT_H_
