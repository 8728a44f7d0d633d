// ShardCore: one server shard's state and rules, as plain C++ (no gRPC), so
// tests drive it directly (DESIGN 1, 2.1, 4).
//
// For each partition it owns, the core collects the N workers' pushes of the
// current step, and when the last arrives: sums the decoded messages in rank
// order and divides by N, recompresses with the shard's error buffer, applies
// the reply to its mirror of x, m, v, and answers every waiting worker with
// the same bytes. It then keeps that reply and a hash of each worker's push,
// so a retried push gets the same reply, for the last
// checkpoint.replay_steps completed steps (one without checkpoints): a worker
// restarted from its own checkpoint replays its pushes from there and gets
// the replies it had, its pushes checked against the hashes (DESIGN 4).
// Memory stays bounded: those replies and one pending step per partition.
//
// Every push is validated before anything is stored; a rejected push leaves
// the shard as it was. Codes: FAILED_PRECONDITION for the wrong layout, step,
// phase or conflicting bytes; INVALID_ARGUMENT for malformed input;
// UNAVAILABLE before the initial parameters arrived; DEADLINE_EXCEEDED for
// pushes whose step did not complete within the recovery timeout.
//
// Thread-safe: partitions lock independently; callbacks run outside locks,
// on a compute-pool thread or the thread of the push that completed the step
// (Create), or of ExpireWaiting or Abort.
#ifndef MORSE_SERVER_SHARD_CORE_H_
#define MORSE_SERVER_SHARD_CORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compress/clipping.h"
#include "compress/compute_pool.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/sync.h"
#include "proto/checkpoint_file.h"
#include "proto/job_config.h"

namespace morse::server {

struct PushArgs {
  int64_t step = 0;
  uint32_t rank = 0;
  uint32_t partition = 0;
  uint64_t layout_fingerprint = 0;
  compress::CodecKind codec = compress::CodecKind::kFp32;
  std::string payload;
  std::optional<compress::StepHyper>
      hyper;  // the workers' lr and weight decay, if set
  std::string
      buffers;  // rank 0's module buffers, partition 0 only (morse.proto)
  // The previous step's sum of squares of the averaged gradient over the
  // whole model, when that step clipped it (Commit).
  std::optional<double> previous_grad_sum_of_squares;
  // The previous step's max_norm, when the workers chose it (workers_clip).
  std::optional<float> previous_clip_max_norm;
  // The previous step's clip of part of the model (StepCommit), if any.
  compress::ClipPieces previous_clip_pieces;
  // onebit_lamb: the previous step's commit (CommitValues).
  std::vector<double> previous_commit;
  // The workers clip this step's averaged gradient by a max_norm they
  // commit after it (morse.proto PushRequest.workers_clip).
  bool workers_clip = false;
  // A worker's re-send to this shard after it restarted: the ranks the
  // step's reply left out then (PushRequest.replay_absent), ascending; the
  // step is recomputed with that membership.
  std::optional<std::vector<uint32_t>> replay_absent;
  // Step 0, and the step after a ReplaceX: the hash of the worker's x over
  // the partition (PushRequest.x_hash), checked against the mirror's.
  std::optional<uint64_t> x_hash;
  // The previous step's gradient over the partition as the workers amended
  // it (StepCommit::amended), if they did.
  std::string previous_amended;
};

// What the workers commit after a step whose mirror update needs the whole
// model: the averaged gradient's sum of squares (clip_grad_norm), or the
// optimizer's commit (compress::Optimizer::CommitDoubles values:
// onebit_lamb's per-layer coefficients and state, compress/lamb.h).
struct StepCommit {
  std::optional<double> grad_sum_of_squares;
  // With it, in a step whose pushes said workers_clip: their max_norm.
  std::optional<float> clip_max_norm;
  std::vector<double> values;
  // With a max_norm of 0: the workers' clip of part of the model
  // (compress::ClipPiece; morse.proto CommitRequest.clip_piece_ends).
  compress::ClipPieces clip_pieces;
  // With a max_norm of 0 and no pieces: the step's gradient as the workers
  // amended it, by partition id (fp32 bytes, one per element; morse.proto
  // CommitRequest.amended): the commit is of those partitions alone.
  std::vector<std::pair<uint32_t, std::string>> amended;
};

// The absl::Status payload of an ABORTED push that is ahead of its
// partition: the step the partition accepts, in decimal (the gRPC service
// sends it as trailing metadata `morse-next-step`).
inline constexpr const char* kNextStepPayload = proto::kNextStepKey;

struct Reply {
  int64_t step = 0;
  uint32_t partition = 0;
  compress::CodecKind codec = compress::CodecKind::kFp32;
  std::string payload;
  std::string buffers;  // rank 0's module buffers of this step (partition 0)
  // When the step clips the averaged gradient: this partition's sum of
  // squares of the decoded reply (compress::GradientSumOfSquares).
  std::optional<double> grad_sum_of_squares;
  // When the workers clip (their pushes said workers_clip): the decoded
  // reply's norms of order 1 and infinity too (compress::GradientOtherNorms),
  // for a worker's clip_grad_norm_ with norm_type 1 or inf.
  std::optional<compress::OtherNorms> grad_other_norms;
  // An optimizer with a layer rule (onebit_lamb), when the step does not
  // clip the average: the layer statistics of the partition's pieces after
  // this reply, from the mirror (compress::PieceStats), which the workers
  // then need not take.
  std::vector<double> piece_stats;
  // The ranks the average left out (membership, design.md 4, "Membership"),
  // ascending.
  std::vector<uint32_t> absent;
};

// One partition's mirror, for workers that (re)join (DESIGN 4).
struct PartitionSnapshot {
  int64_t completed_steps = 0;
  std::vector<float> x, m, v;
  std::vector<float> server_error;  // only when asked for (saving a whole run)
  uint64_t x_hash = 0;  // only when asked for: compress::BytesHash of x
  // The optimizer's own arrays (compress::Optimizer::State, in order):
  // onebit_lamb's v' of the partition and coeff_freeze, last_factor of
  // every layer; none for the others.
  std::vector<compress::NamedState> state;
};

// What ShardCore::FetchPartition copies out of a partition's mirror.
struct FetchWhat {
  bool model = true;          // x, m, v and the optimizer's own arrays
  bool server_error = false;  // the shard's error buffer
  bool x_hash = false;        // compress::BytesHash of x (PushRequest.x_hash's)
};

using ReplyCallback =
    std::function<void(absl::StatusOr<std::shared_ptr<const Reply>>)>;

struct ShardStatus {
  uint32_t shard = 0;
  compress::Range range;
  uint64_t layout_fingerprint = 0;
  uint32_t workers = 0;
  uint32_t partitions = 0;
  uint32_t partitions_initialized = 0;
  int64_t completed_steps = 0;  // by every partition
  // Every partition keeps the replies of its completed steps from this one
  // on (a restarted worker can replay from here).
  int64_t replies_kept_from = 0;
  uint64_t pushes_accepted = 0;
  uint64_t pushes_rejected = 0;
  // Ranks out of the membership of some partition (design.md 4, "Membership"),
  // ascending, and how many times a step completed without a worker.
  std::vector<uint32_t> out;
  uint64_t workers_dropped = 0;
  // Partition steps completed without stragglers (timeouts.straggler_seconds;
  // design.md 4, "Stragglers"), counted in workers_dropped too.
  uint64_t straggler_steps = 0;
};

class ShardCore {
 public:
  // Called once per step when every partition of the shard has completed it,
  // in step order and one at a time, with the mirror exactly as after that
  // step (for logs, checkpoints and tests): a partition whose pushes
  // complete a later step meanwhile is held until it returns.
  using StepObserver = std::function<void(int64_t step, const ShardCore& core)>;

  // RESOURCE_EXHAUSTED, before allocating anything, if the shard's state
  // (x, m, v and its error buffer) exceeds memory_limit bytes (default: this
  // host's memory; 0: no limit). With compute_threads > 0, a partition whose
  // last push arrived is completed (averaged, recompressed, answered, its
  // mirror updated) on a compute pool of that many threads, partitions in
  // parallel; with 0, on the thread of that last push, before Push returns.
  // The replies' bits do not depend on it.
  static absl::StatusOr<std::unique_ptr<ShardCore>> Create(
      const proto::JobSpec& job, uint32_t shard,
      uint64_t memory_limit = proto::HostMemoryBytes(),
      int compute_threads = 0);
  ~ShardCore();
  ShardCore(const ShardCore&) = delete;
  ShardCore& operator=(const ShardCore&) = delete;

  // Rank 0's initial values (fp32 bytes) of one partition, before step 0.
  absl::Status InitPartition(uint32_t rank, uint32_t partition,
                             uint64_t layout_fingerprint,
                             absl::string_view values);

  // Calls done exactly once: with the reply when the step completes (maybe
  // before Push returns), or with an error.
  void Push(PushArgs args, ReplyCallback done);

  // Called, under a partition's lock, when that partition's step gets a
  // straggler deadline (timeouts.straggler_seconds after its min_workers-th
  // push): the caller should run ExpireWaiting then.
  using Wakeup = std::function<void(absl::Time deadline)>;
  void SetWakeup(Wakeup wakeup) { wakeup_ = std::move(wakeup); }
  // The earliest straggler deadline of a step in flight (InfiniteFuture if
  // none): when ExpireWaiting would next complete one.
  absl::Time NextDeadline() const;

  // The longest wait for missing pushes beyond the step timeout, described
  // (step, partition, how long, which ranks), for progress lines.
  std::optional<std::string> Stalled(absl::Time now) const;

  // Fails the waiting pushes of every partition whose oldest push for the
  // current step is older than the recovery timeout (a stalled or restarting
  // worker gets that long); those pushes are dropped. In an elastic job
  // (min_workers below workers; design.md 4, "Membership") a partition that has
  // waited step_seconds with at least min_workers pushes completes with them
  // instead, the missing ranks leaving its membership until they push
  // again; so does one that has waited straggler_seconds since its
  // min_workers-th push. Returns a line for each change of the first kind,
  // for the shard's log (stragglers are counted: ShardStatus).
  std::vector<std::string> ExpireWaiting(absl::Time now);

  // Rank `rank` stops the job at `step` (its step failed, `reason` says
  // why): every waiting push, and every later push of `step` or after, fails
  // with FAILED_PRECONDITION "rank R stopped the job at step T: REASON", so
  // the other workers learn why at once. The mirror is unchanged; the first
  // abort wins (later ones return OK and change nothing). Errors as for
  // pushes for a bad rank or layout.
  absl::Status Abort(uint32_t rank, int64_t step, uint64_t layout_fingerprint,
                     absl::string_view reason);
  // Gradient clipping: the sum of squares over the whole model of step
  // `step`'s averaged gradient (compress::ClipsAverage, or a step whose
  // pushes said workers_clip: then with the workers' `clip_max_norm`, which
  // such a step needs and no other takes), which the mirror
  // needs before it can apply that step; until then checkpoints and
  // FetchPartition wait (FAILED_PRECONDITION / UNAVAILABLE) and the step
  // observer is not called. Every push of the next step carries it too.
  // FAILED_PRECONDITION for a step that is not the last completed one or
  // does not clip, or a total that differs from the one already committed
  // or is below a partition's own (a step not completed yet: with
  // kNextStepPayload, the steps completed); INVALID_ARGUMENT for a negative
  // or non-finite total or max_norm. Nothing changes on any error; the same
  // commit again is OK.
  absl::Status Commit(uint32_t rank, int64_t step, uint64_t layout_fingerprint,
                      double grad_sum_of_squares,
                      std::optional<float> clip_max_norm = std::nullopt);
  // onebit_lamb's commit of step `step` (compress::Replica::CommitStep: each
  // layer's coefficient and state after the step), which the mirror needs
  // to move x; as Commit otherwise (every step of onebit_lamb waits for
  // one). INVALID_ARGUMENT for a malformed commit.
  absl::Status CommitValues(uint32_t rank, int64_t step,
                            uint64_t layout_fingerprint,
                            std::vector<double> commit);
  // Either, or both in one commit: a step of an optimizer that commits
  // values whose averaged gradient was clipped (onebit_lamb's warmup with
  // clip_grad_norm) needs both, and is refused (FAILED_PRECONDITION) with
  // one alone. Commit and CommitValues are this with one part.
  absl::Status CommitStep(uint32_t rank, int64_t step,
                          uint64_t layout_fingerprint,
                          const StepCommit& commit);
  // Forgets an abort: a worker joined again (the job restarts).
  void ClearAbort();
  // Which ranks are in the membership of some partition: every rank, but
  // in an elastic job after steps that completed without some (design.md 4,
  // "Membership").
  std::vector<bool> InSomeMembership() const;
  // A fresh core's membership, before any push: the ranks that laid an
  // elastic job's model out anew (ShardHost::JoinNext). The steps average
  // those ranks alone, and their replies name the others as left out.
  void SetMembership(const std::vector<bool>& members);
  // The shard is shutting down (a signal), or a new layout replaced this
  // core (ShardHost::JoinNext): every waiting push, and every push from now
  // on, fails with `why` (UNAVAILABLE at shutdown: the workers retry
  // against the restarted shard, which takes the step again), so that no
  // call is left open for the server's shutdown to wait on. The waiting
  // pushes of the step in flight are dropped, as an expired step's are.
  void Stop(const absl::Status& why);
  // The abort's message, if the job is stopped.
  std::optional<std::string> aborted() const;

  const proto::JobSpec& job() const { return job_; }

  void SetStepObserver(StepObserver observer) {
    observer_ = std::move(observer);
  }

  // Writes x, m, v, the server error buffer and the step to `path`
  // atomically (proto/checkpoint_file.h). FAILED_PRECONDITION, and nothing
  // written, if the shard is in the middle of a step (partitions at
  // different steps) or not initialized.
  absl::Status SaveCheckpoint(const std::string& path) const;
  // The same checkpoint, copied into memory under the partitions' locks and
  // not written: a caller may write it from another thread (fsync takes far
  // longer than the copy) while training goes on.
  absl::StatusOr<proto::CheckpointWriter> Snapshot() const;
  // Loads a checkpoint of this shard and job before any push. NOT_FOUND if
  // there is none; DATA_LOSS if it is corrupt; FAILED_PRECONDITION if it is
  // another shard's or another job's (layout or algorithm). The shard is
  // unchanged on any error.
  absl::Status RestoreCheckpoint(const std::string& path);
  // The mirror of one partition; INVALID_ARGUMENT or FAILED_PRECONDITION as
  // for pushes, UNAVAILABLE before initialization.
  absl::StatusOr<PartitionSnapshot> FetchPartition(uint32_t partition,
                                                   uint64_t layout_fingerprint,
                                                   FetchWhat what = {}) const;
  // Rank 0 restores one partition of a saved run (morse.torch's
  // load_state_dict) before the job's first step: x, m, v, the server
  // error and the steps completed (onebit_lamb: also v' and the layers'
  // state), as FetchPartition({.server_error = true}) gave them. Allowed while
  // no push of the partition has arrived since it was initialized or last
  // restored; FAILED_PRECONDITION once training has moved on, INVALID_ARGUMENT
  // for wrong sizes or non-finite values, and nothing changes on any error.
  absl::Status RestorePartition(uint32_t rank, uint32_t partition,
                                uint64_t layout_fingerprint,
                                const PartitionSnapshot& state);
  // Rank 0 replaces one partition's x between two steps of a job that has
  // trained (weights changed after a step: design.md 4): `step` must be
  // the partition's next one, with no push of it arrived yet unless the
  // partition holds this x already (a change that left it as it was:
  // another rank may have found the shards holding its weights once rank
  // 0 had given the partitions that changed, and pushed); the rest of
  // its state (m, v, error buffers, kept replies) is kept. The pushes of
  // `step` must then carry the hash of this x (PushRequest.x_hash), so a
  // rank that did not change its weights the same way fails that step.
  // Where `step` begins a zero_one_adam interval (the step before it
  // exchanged, it does not) x is the interval's anchor, and the pushes of
  // its sync carry the hash.
  // The same x again is OK and changes nothing (rank 0 restarted and
  // replaying). In an elastic job the same, rank 0 giving x as long as it
  // is in the job; a rank left out of `step` shows x's hash with its late
  // push (CheckLeftOutX). FAILED_PRECONDITION for another rank, another
  // step or a push of `step` already in; UNAVAILABLE while the last
  // step waits for its commit; INVALID_ARGUMENT for a wrong size or
  // non-finite values; nothing changes on any error. Once every partition
  // of the shard holds its new x, the change observer runs.
  absl::Status ReplaceX(uint32_t rank, uint32_t partition,
                        uint64_t layout_fingerprint, int64_t step,
                        absl::Span<const float> x);
  // Runs once every partition of the shard holds state given between steps
  // (`what` says which): ReplaceX's new x before `step`, or
  // RestorePartition's saved run (a resume, or a layout made anew mid-job)
  // at `step`. The runtime
  // writes a checkpoint at once: a restart cannot replay around a change,
  // nor find only a checkpoint of the old layout (design.md 4).
  using ChangeObserver = std::function<void(int64_t step, const ShardCore& core,
                                            absl::string_view what)>;
  void SetChangeObserver(ChangeObserver observer) {
    change_observer_ = std::move(observer);
  }

  // Cheap: counters and per-partition progress (the mirror checksum is
  // MirrorChecksum(), a pass over the shard).
  ShardStatus Status() const;
  uint64_t MirrorChecksum()
      const;  // call only while no step completes (the step observer)
  double ServerErrorNorm() const;  // likewise
  const compress::Layout& layout() const { return layout_; }
  uint32_t shard() const { return shard_; }

 private:
  struct PartitionState;

  ShardCore(const proto::JobSpec& job, uint32_t shard, compress::Layout layout);

  absl::Status CheckCommon(uint32_t rank, uint32_t partition,
                           uint64_t fingerprint) const;
  // The ranks of p's membership whose push of the step in flight is missing.
  std::vector<uint32_t> Missing(const PartitionState& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Runs under the partition's lock once all N pushes are in.
  absl::StatusOr<std::shared_ptr<const Reply>> Complete(PartitionState& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // A completed step's outcome, for Answer to deliver outside the lock.
  struct Completion {
    std::shared_ptr<const Reply> reply;
    absl::Status failure;
    // The step completed the shard's: its observer is due (RunObservers).
    bool observe = false;
    std::vector<std::pair<uint32_t, ReplyCallback>> waiters;
  };
  // Push, in the order it runs: the arguments alone (before any lock);
  // for a completed step, the reply it had (a retry, or a restarted
  // worker's replay); for the step in flight, everything the push must
  // agree with (its commit of the step before taken out of args into
  // *carried, *commits when that completes it), then the push kept and
  // the step completed when it is the last one (StartCompletion).
  // AcceptPush moves `done` only when it succeeds.
  absl::Status CheckPushArgs(const PushArgs& args) const;
  absl::StatusOr<std::shared_ptr<const Reply>> KeptReply(
      const PartitionState& p, const PushArgs& args, uint64_t hash) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // A push of a step that completed without its rank (an elastic job's
  // straggler, or a rank back from a restart), at the step after rank 0
  // replaced x: it must show that x (PushArgs::x_hash), as the step's own
  // pushes did. No hash of its own to compare it with otherwise.
  absl::Status CheckLeftOutX(const PartitionState& p,
                             const PushArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  absl::Status CheckCurrentPush(const PartitionState& p, PushArgs& args,
                                StepCommit* carried, bool* commits) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  absl::Status AcceptPush(PartitionState& p, PushArgs& args, uint64_t hash,
                          ReplyCallback& done, Completion* completion,
                          bool* schedule) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Every push of p's step is in: completes it inline into *completion
  // (without a pool), or marks it for the pool (*schedule), or, while the
  // observer of an earlier step has not returned, holds it: RunObservers
  // then completes it. Without the hold a partition whose commit came
  // early (Commit, or the other partitions' pushes) could move the mirror
  // under an observer still reading it.
  void StartCompletion(PartitionState& p, Completion* completion,
                       bool* schedule) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // The hold: true, and p marked completing and held, if it applies.
  bool HoldForObservers(PartitionState& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  Completion CompleteLocked(PartitionState& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // The pool's task for a partition whose pushes are all in (and a held
  // one's completion, without a pool).
  void CompleteOnPool(PartitionState& p);
  // The step observers due, then the waiting pushes' callbacks, then the
  // mirror.
  void Answer(PartitionState& p, Completion completion);
  // Applies the partition's last reply to the mirror if that is still to do
  // and possible (not waiting for the step's gradient norm).
  void ApplyMirror(PartitionState& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // The mirror takes reply `r` of partition `part`, this shard's own
  // (compress::Replica::ApplyReply with the step's `hyper` and clip factor
  // `scale`; `segment_stats` and `clip_pieces` as there), under the
  // partition's lock.
  void ApplyOwnReply(
      const Reply& r, const compress::Partition& part,
      const std::optional<compress::StepHyper>& hyper, float scale,
      std::vector<double>* segment_stats = nullptr,
      absl::Span<const compress::ClipPiece> clip_pieces = {}) const;
  // The optimizer's own arrays of [begin, begin + n) (a partition of p's,
  // or the whole shard for p any partition at the same step): the
  // per-element ones from the mirror, the others p's.
  std::vector<compress::NamedState> StateOf(const PartitionState& p,
                                            uint64_t begin, uint64_t n) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Checks a commit of step `step` against partition p; Commit's errors.
  // `*applies`: p was waiting for it.
  absl::Status CheckCommit(const PartitionState& p, uint32_t rank, int64_t step,
                           const StepCommit& commit, bool* applies) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // Records a checked commit; the caller then moves the mirror (MirrorSoon).
  void ApplyCommit(PartitionState& p, const StepCommit& commit) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // ApplyMirror on the pool (here without one), so that the worker whose
  // commit completed the step need not wait for the mirror's update: all
  // that reads the mirror applies it first.
  void MirrorSoon(PartitionState& p) ABSL_LOCKS_EXCLUDED(p.mu);
  void FlushMirrors() const;  // ApplyMirror on every partition
  // The step p accepts pushes of: its next step, or zero_one_adam's next
  // sync after local steps.
  int64_t NextExchange(const PartitionState& p) const
      ABSL_SHARED_LOCKS_REQUIRED(p.mu);
  // Counts a partition's completion of `step` (its reply out, and its
  // commit in where the step waits for one), under that partition's lock:
  // whoever finds the partition's step completed finds it counted. True
  // when the shard has now completed a step, whose observer is due.
  bool CountCompleted(int64_t step) ABSL_LOCKS_EXCLUDED(progress_mu_);
  // Runs the observer of each step the shard has completed, in order, one
  // at a time, then completes the partitions held meanwhile. Called with
  // no partition's lock held.
  void RunObservers() ABSL_LOCKS_EXCLUDED(observer_mu_, progress_mu_);
  // The abort that refuses a push of `step`, if any.
  std::optional<absl::Status> AbortFor(int64_t step) const;
  // Stop's status once the shard is shutting down.
  std::optional<absl::Status> Stopping() const;

  proto::JobSpec job_;
  uint32_t shard_;
  compress::Layout layout_;
  compress::Range range_;
  // Replies go out before the mirror applies them (the shard answers
  // first); readers of the mirror (checkpoints, FetchPartition, checksums)
  // apply what is pending, hence mutable.
  mutable compress::Replica mirror_;
  compress::ErrorFeedback server_error_;
  std::vector<std::unique_ptr<PartitionState>> partitions_;
  StepObserver observer_;
  ChangeObserver change_observer_;
  Wakeup wakeup_;

  // Taken inside a partition's lock, never around one.
  mutable Mutex abort_mu_;
  std::optional<std::pair<int64_t, std::string>> abort_
      ABSL_GUARDED_BY(abort_mu_);  // step, message
  std::optional<absl::Status> stopping_ ABSL_GUARDED_BY(abort_mu_);  // Stop

  // Held while observers run; taken outside every other lock.
  Mutex observer_mu_;
  mutable Mutex progress_mu_;
  uint32_t initialized_ ABSL_GUARDED_BY(progress_mu_) = 0;
  // The last step every partition has completed; the steps up to it whose
  // observer has not run yet, in order; the last step whose observer has
  // returned (observed_step_ once none is due); the partitions whose next
  // step is held for them (StartCompletion).
  int64_t observed_step_ ABSL_GUARDED_BY(progress_mu_) = -1;
  std::deque<int64_t> unobserved_ ABSL_GUARDED_BY(progress_mu_);
  int64_t released_step_ ABSL_GUARDED_BY(progress_mu_) = -1;
  std::vector<PartitionState*> held_ ABSL_GUARDED_BY(progress_mu_);
  std::map<int64_t, uint32_t> completions_
      ABSL_GUARDED_BY(progress_mu_);  // step -> partitions
  uint64_t accepted_ ABSL_GUARDED_BY(progress_mu_) = 0;
  uint64_t rejected_ ABSL_GUARDED_BY(progress_mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(progress_mu_) = 0;
  uint64_t straggler_steps_ ABSL_GUARDED_BY(progress_mu_) = 0;
  // The partitions whose x was replaced before step replaced_step_.
  int64_t replaced_step_ ABSL_GUARDED_BY(progress_mu_) = -1;
  std::set<uint32_t> replaced_ ABSL_GUARDED_BY(progress_mu_);
  // The partitions RestorePartition gave the state of restored_step_.
  int64_t restored_step_ ABSL_GUARDED_BY(progress_mu_) = -1;
  std::set<uint32_t> restored_ ABSL_GUARDED_BY(progress_mu_);

  // Completes partitions when compute_threads > 0 (Create); destroyed
  // first, so what it runs finds the partitions alive.
  std::unique_ptr<compress::ComputePool> pool_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_SHARD_CORE_H_
