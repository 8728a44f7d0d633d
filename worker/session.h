// Session: one worker's membership in a job — its connections, its replica of
// x, m, v, its error buffer and its step — and the step of DESIGN 2.1/2.2:
// encode each partition of the gradient (local momentum in 1-bit Adam's
// compression phase, error feedback where the phase has it), push, and apply
// every reply to the replica. The trainer of the built-in workloads and the
// PyTorch binding both run on it.
//
// One thread drives a session; replies are applied on gRPC threads or the
// session's compute pool, and CPU encodes may run there too.
#ifndef MORSE_WORKER_SESSION_H_
#define MORSE_WORKER_SESSION_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/clipping.h"
#include "compress/compute_pool.h"
#include "compress/error_feedback.h"
#include "compress/replica.h"
#include "proto/checkpoint_file.h"
#include "proto/job_config.h"
#include "worker/client.h"
#include "worker/engine/engine.h"
#include "worker/step_exchange.h"

namespace morse::worker {

class Session {
 public:
  // Connects to every shard with `security`'s credentials (waiting up to the
  // connect timeout) and joins the job. `x` is where the parameters live
  // (job.algorithm.layout.dim floats, owned by the caller); empty: the
  // session owns them. compute_threads > 0: partitions are encoded (on the
  // CPU) and replies applied on the session's compute pool of that many
  // threads, which also runs the optimizer's passes over the model between
  // exchanges; 0: on the driving thread and gRPC's. INVALID_ARGUMENT if
  // negative.
  static absl::StatusOr<std::unique_ptr<Session>> Connect(
      const proto::JobSpec& job, uint32_t rank,
      std::vector<std::string> servers, const proto::SecurityOptions& security,
      absl::Span<float> x = {}, int compute_threads = 0);
  // The same over any transport (tests: tests/inproc's in-process cluster).
  static absl::StatusOr<std::unique_ptr<Session>> Connect(
      const proto::JobSpec& job, uint32_t rank,
      std::unique_ptr<Transport> transport, absl::Span<float> x = {},
      int compute_threads = 0, bool tls = false);
  // A step still in flight (begun and never finished: a script that ends
  // with a DiLoCo sync overlapped) is waited for first: its encodes and
  // replies use the engine.
  ~Session();

  // Starts training. Fresh: rank 0 uploads x as the initial parameters and
  // every other rank replaces its x with them, so all start equal. Resume:
  // from `checkpoint` (this worker's) if it holds the whole state of a step
  // the shards have reached — steps they completed since are replayed, the
  // shards answering each push with the reply it had (a worker restarted
  // mid-run); else x, m, v come from the shards and the step from their
  // progress, and the error buffer from `checkpoint` if it is of that step
  // (from zero otherwise, saying so). Returns the first step to run.
  absl::StatusOr<int64_t> Start(bool resume,
                                const std::string& checkpoint = "");

  // Whether every shard already holds its initial parameters (the job has
  // started, or the shards resumed from checkpoints).
  absl::StatusOr<bool> ShardsHoldModel();

  // Waits until all N workers have joined (see PushClient::WaitAllJoined).
  absl::Status WaitAllJoined() { return client_->WaitAllJoined(); }

  // One whole step from the host gradient `grad` (dim floats; host engine
  // only, FAILED_PRECONDITION on a GPU). After a step fails
  // the replica may hold some of its partitions' updates, so every later
  // Begin/Step fails with FAILED_PRECONDITION: the worker must rejoin
  // (resume). A failed step stops the job on the shards (ShardCore::Abort):
  // every other worker's step fails at once with this one's reason.
  absl::Status Step(absl::Span<const float> grad,
                    StepTraffic* traffic = nullptr);

  // The same step in pieces, for overlapping with a backward pass: Begin,
  // then SendPartition for each partition whose gradient is complete (any
  // order, each once), then Finish, which sends the rest and waits.
  absl::Status Begin(absl::Span<const float> grad);
  // The learning rate and weight decay of the steps that begin from now on
  // (PyTorch's param_groups), sent with every push and applied by every
  // replica and mirror: one for the whole model, or one per segment of the
  // layout (the job's external.groups), each push carrying its partition's;
  // empty: the job's schedule. INVALID_ARGUMENT for negative or non-finite
  // values or another count.
  absl::Status SetStepHyper(std::vector<compress::StepHyper> hypers);
  // Rank 0's module buffers for the steps that begin from now on, sent with
  // partition 0's push; every worker finds them in received_buffers()
  // after Finish (empty when rank 0 sent none).
  void SetStepBuffers(std::string buffers) { buffers_ = std::move(buffers); }
  // Replies are applied as they arrive (on gRPC threads, overlapping the
  // rest of the exchange) by default; deferred, they are kept and applied
  // by Finish, in partition order, so x, m and v change only when the step
  // ends (morse.torch: parameters stay as they were until step(), as in
  // torch). The same bits either way.
  void SetDeferApply(bool defer) { defer_apply_ = defer; }
  const std::string& received_buffers() const { return received_buffers_; }
  // The ranks each partition's average of the last step left out
  // (membership, design.md 4, "Membership": a worker late by
  // timeouts.step_seconds in a job with min_workers below workers), by
  // partition id; empty when every worker was in, and after a step that
  // exchanged nothing.
  const compress::Absent& absent() const { return absent_; }
  // The ranks in every partition's average of the last step, and the
  // others (left out of some partition's).
  std::vector<uint32_t> members() const { return RanksWhere(true); }
  std::vector<uint32_t> left_out() const { return RanksWhere(false); }
  // The workers clip the steps that begin from now on by a max_norm chosen
  // after their backward pass (morse.torch's clip_grad_norm_; design.md
  // 2.6): ClipAt before Finish, or none (max_norm 0). Where the step has
  // an averaged gradient its pushes say so and the shards send its norm;
  // in a compressing step each worker clips its own gradient, so its
  // pushes wait for ClipAt or Finish. FAILED_PRECONDITION in a job with
  // clip_grad_norm.
  absl::Status SetStepClipping(bool on);
  // Clips the step in flight (begun with SetStepClipping(true)) by
  // `max_norm` (0: no clip) and returns the sum of squares it is clipped
  // by: of the averaged gradient, sending what is left and waiting for
  // every reply (DDP's clip_grad_norm_ after its all-reduce), or of this
  // worker's own gradient in a compressing step, whose pushes then leave at
  // Finish. It may be called again before Finish, and the last max_norm is
  // the one the step clips by (morse.torch composes several clip_grad_norm_
  // calls into one). INVALID_ARGUMENT for a negative or non-finite max_norm.
  absl::StatusOr<double> ClipAt(float max_norm);
  // Clips parts of the averaged gradient of the step in flight by factors
  // of the workers' own (clip_grad_norm_ over some of the parameters;
  // design.md 2.6): after ClipAt has waited for every reply, in place of
  // its max_norm (the step's is 0 from here on). Every worker's pieces
  // must be the same; the commit carries them to the shards' mirrors.
  // FAILED_PRECONDITION outside such a step (a compressing step clips the
  // worker's own gradient: scale it before Finish); INVALID_ARGUMENT for
  // pieces compress::ValidateClipPieces refuses. Empty: none.
  absl::Status ClipPiecesAt(compress::ClipPieces pieces);
  // Whether the step in flight clips each worker's own gradient (a
  // compressing step, compress::ClipsLocally) rather than the average.
  bool clips_locally() const { return InStep() && clips_locally_; }
  // The averaged gradient's norm of order `norm_type` (1, 2 or infinity)
  // over the whole model, from the shards' norms of every reply, once ClipAt
  // has waited for them in a step that averages: what DDP's clip_grad_norm_
  // returns with that norm_type. morse.torch clips by another norm with the
  // max_norm whose L2 factor is that norm's (design.md 2.6).
  // FAILED_PRECONDITION before ClipAt, in a compressing step, or where a
  // shard sent no such norm; INVALID_ARGUMENT for another norm_type.
  absl::StatusOr<double> AverageNorm(double norm_type) const;
  // The averaged gradient itself (dim floats, the replies' decoded values,
  // before any clip), under the same conditions as AverageNorm: what
  // morse.torch takes a norm of another order of (torch's clip_grad_norm_
  // with norm_type 3, 0.5, ...); a GPU engine's replies are read where
  // they are staged on the host (Engine::StagedReply). INVALID_ARGUMENT for
  // another size.
  absl::Status AverageGradient(absl::Span<float> out) const;
  // The step's gradient as every replica and mirror will apply it: the
  // averaged gradient scaled by the step's clip (ClipAt's max_norm or
  // ClipPiecesAt's pieces, one fp32 multiplication an element, as
  // compress::Replica::ApplyReply does), under AverageGradient's
  // conditions: what DDP leaves in .grad after its clip_grad_norm_, which
  // morse.torch shows the script.
  absl::Status ClippedAverage(absl::Span<float> out) const;
  // Replaces the gradient of the step in flight, once ClipAt has waited
  // for every reply in a step that averages, by `gradient` (dim floats):
  // every replica and the shards' mirrors apply the step's update to it in
  // place of the clipped average (design.md 2.6, "Edits after the clip":
  // a script's edit of .grad after clip_grad_norm_ that no clip factor
  // gives). Every worker must amend alike: the commit and the next step's
  // pushes carry it, and a shard refuses another. A later ClipAt or
  // ClipPiecesAt of the step undoes it. FAILED_PRECONDITION outside such a
  // step; INVALID_ARGUMENT for another size or a value that is not finite.
  absl::Status AmendAt(std::vector<float> gradient);
  absl::Status SendPartition(uint32_t partition);
  absl::Status Finish(StepTraffic* traffic = nullptr);

  // Where the per-step work runs (worker/engine/engine.h): the host engine
  // over replica() and error() from the start; MoveTo("cuda", arrays) moves
  // x, m, v and the error buffer to a GPU (into the caller's device arrays
  // if given). SyncHost brings replica() and error() up to date from the
  // engine (checksums, checkpoints, the end of training; nothing on the
  // host).
  absl::Status MoveTo(const std::string& kind, DeviceArrays arrays = {});
  Engine& engine() { return *engine_; }
  absl::Status SyncHost();
  // A step from the gradient already in the engine (a workload's hook via
  // engine().Gradient, or the device array given to MoveTo); in pieces:
  // BeginFromEngine, SendPartition as gradients complete (after
  // engine().WaitFor(the stream that wrote them)), Finish.
  absl::Status StepFromEngine(StepTraffic* traffic = nullptr);
  absl::Status BeginFromEngine();

  // Writes this worker's checkpoint to `path`, between steps: its whole
  // state at step() (x, m, v, the error buffer, and what the optimizer
  // carries between steps), so that a restarted worker can replay from
  // there (Start). The header's step is the one after the last exchange
  // (after zero_one_adam's local steps, the step after the last sync): the
  // shards' step a worker taking x, m, v from them would start at.
  absl::Status SaveCheckpoint(const std::string& path) const;

  int64_t step() const { return step_; }
  // The step after the last exchange: step() but inside a zero_one_adam
  // local interval, where it is the step after the interval's last sync
  // (the shards hold the state of that step, this worker a later one).
  int64_t exchanged_step() const;
  // Whether a step has begun and not finished.
  bool step_in_flight() const { return InStep(); }
  // The sum of squares of the last step's averaged gradient, over the whole
  // model, when that step clipped it (compress::ClipsAverage); else none.
  std::optional<double> grad_sum_of_squares() const {
    return previous_grad_sum_of_squares_;
  }
  const proto::JobSpec& job() const { return job_; }
  const compress::Layout& layout() const { return layout_; }
  compress::Replica& replica() { return replica_; }
  compress::ErrorFeedback& error() { return error_; }
  const compress::StepPlan& plan() const { return plan_; }
  // Sets the step counter and the optimizer state (load_state_dict) and
  // brings the shards to the same run: if they hold that step already
  // (they survived, or resumed from their checkpoints) nothing more;
  // else, if they have not trained, rank 0 restores them from
  // `server_error` (what ServerError() gave when the run was saved) and its
  // x, m, v, and every other rank waits (up to the connect timeout) until
  // they hold the step. FAILED_PRECONDITION, saying what to do, otherwise
  // (shards at another step; rank 0 without the server error).
  // The optimizer's own state beyond m and v, which Restore needs too when
  // it has any: its arrays (compress::Optimizer::State, in order;
  // onebit_lamb's v' and layer state, design.md 2.8) and the last step's
  // commit that the next pushes carry (CommitDoubles values; none before
  // the first step).
  struct OwnState {
    std::vector<compress::NamedState> arrays;
    std::vector<double> commit;
  };
  //
  // Inside a zero_one_adam local interval (design.md 2.7) the worker is at
  // a later step than the shards, which hold the interval's last sync:
  // `interval` then carries this worker's interval state (Replica::
  // SaveInterval's arrays and its last local step) and, for rank 0 against
  // fresh shards, their m at that sync (ShardsAtSync's); the shards are
  // brought to the step after the sync, with the anchor as their x, and
  // this worker to `step`, its x the caller's (its own, loaded before).
  struct IntervalState {
    std::vector<compress::NamedState> arrays;
    int64_t last_local_step = -1;
    std::vector<float> shards_m;  // empty: none (not rank 0's)
  };
  absl::Status Restore(int64_t step, absl::Span<const float> m,
                       absl::Span<const float> v, absl::Span<const float> error,
                       absl::Span<const float> server_error = {},
                       const OwnState* own = nullptr,
                       const IntervalState* interval = nullptr);
  // This worker's OwnState (state_dict), between steps.
  absl::StatusOr<OwnState> SavedOwn();
  // Between steps inside a zero_one_adam local interval (else
  // FAILED_PRECONDITION): this worker's IntervalState (state_dict), its
  // shards_m left empty.
  absl::StatusOr<IntervalState> SavedInterval();
  // Between steps inside a zero_one_adam local interval: the shards' m and
  // error buffers (dim floats each) at the interval's last sync, which no
  // worker holds (rank 0's state_dict). FAILED_PRECONDITION where the shards
  // are not at that sync or their x is not this worker's anchor.
  absl::Status ShardsAtSync(absl::Span<float> m,
                            absl::Span<float> server_error);
  // Between steps, the model as the caller changed it (morse.torch:
  // weights loaded after the optimizer was built, or changed after a step:
  // a clamp_, a load_state_dict) becomes the job's. Before the first step
  // rank 0 restores the shards with its x (the rest of the state as it
  // is: zero at step 0); after a step it replaces their x alone
  // (PushClient::ReplaceX; m, v and the error buffers go on). Every other
  // rank waits, up to the connect timeout, until the shards hold the same
  // x as its own. Its pushes of the next step then carry x's hash
  // (PushRequest.x_hash), so a rank that changed nothing while rank 0 did,
  // or the reverse, fails that step with FAILED_PRECONDITION. Right after
  // a step that exchanged and before a local one (a zero_one_adam interval
  // begins) the same: x becomes the interval's anchor, and the pushes of
  // the interval's sync carry its hash. A rank
  // behind the shards (restarted, replaying) changes nothing there: the
  // hashes of its replayed pushes check its model (design.md 4).
  // In an elastic job the same, rank 0 giving the shards x as long as it
  // is in the job (a rank waits for it up to the connect timeout).
  // FAILED_PRECONDITION, nothing changed, in a step, or where the shards
  // are at an earlier step (inside zero_one_adam's local interval).
  absl::Status ReloadModel();
  // Whether the shards hold this worker's x (after SyncHost) at the step it
  // is at, between steps: morse.torch asks when parameters were written
  // after a step, to tell a write that left every bit as the step left it
  // (evaluation weights swapped in and back) from a change. Compares each
  // partition's hash of x with the shards' (PushClient::CompareX: the
  // model stays on the shards), asked again while a step waits for its commit
  // or partitions are between steps (up to timeouts.connect_seconds);
  // false where they are at another step (an elastic job that went on
  // without this worker, zero_one_adam's local steps). When true, the
  // next step's pushes carry x's hash: rank 0 may have just given the
  // shards this x, changed the same way on every rank (ReloadModel).
  absl::StatusOr<bool> HoldsShardsModel();
  // The shards' error buffers over the whole model after this worker's
  // last step (state_dict on rank 0), between this worker's steps.
  absl::Status ServerError(absl::Span<float> out);

 private:
  Session(const proto::JobSpec& job, uint32_t rank, compress::Layout layout,
          absl::Span<float> x);
  absl::Status
  BeginStep();  // the checks and the exchange, whatever the gradient's source
  void
  StartExchange();  // the exchange of the step in flight (step_hyper_'s hyper)
  // zero_one_adam's local step of the step in flight (compress::Replica::
  // LocalStep), then its exchange if it syncs.
  absl::Status LocalStep();
  bool InStep() const { return exchange_ != nullptr || local_pending_; }
  // INVALID_ARGUMENT unless `own` is given exactly when the optimizer keeps
  // state of its own, with every array (compress::CheckState) and a commit
  // of its size or none.
  absl::Status CheckOwnState(const OwnState* own) const;
  // Loads this worker's whole state at `whole_step` (the checkpoint's
  // "whole_step") from a checkpoint that has it: x, m, v, the error buffer,
  // what the next pushes carry, onebit_lamb's and a zero_one_adam local
  // interval's state. An error, nothing changed, for a malformed one.
  absl::Status RestoreWholeState(const proto::CheckpointReader& reader,
                                 int64_t whole_step);
  // This worker's own gradient's sum of squares in the step in flight
  // (computed once), and its clip factor by max_norm_ (1 for 0, without
  // that pass): a compressing step's clip (ClipsLocally, ClipAt).
  absl::StatusOr<double> OwnSumOfSquares();
  absl::StatusOr<float> OwnClipScale();
  // Sends what is left of the step in flight and waits for its replies,
  // once (ClipAt and Finish); the outcome, after Fail.
  absl::Status SendAndWait();
  // The sum of the deferred replies' norms when the step clips the
  // averaged gradient (none otherwise); an error for a missing one.
  absl::StatusOr<std::optional<double>> RepliesSumOfSquares() const;
  // The deferred replies' norms added in partition order, the largest |g|
  // the largest of theirs (NaN if any is): the sum of squares, and the
  // norms of order 1 and infinity too when `others`. INTERNAL for a missing
  // reply, FAILED_PRECONDITION for a missing norm.
  absl::StatusOr<compress::GradientNorms> RepliesNorms(bool others) const;
  // FAILED_PRECONDITION unless the step in flight holds every reply of an
  // averaged gradient (AverageNorm, AverageGradient: after ClipAt, in a
  // step that averages).
  absl::Status HoldsAverage() const;
  // Records the failure of the step in flight and stops the job on the
  // shards (PushClient::Abort) so every other worker fails with it too;
  // not in an elastic job, which goes on without this worker.
  absl::Status Fail(absl::Status status);
  // Sends step `step`'s commit (the last step's: previous_*) where it has
  // one, from rank 0 or, in an elastic job, every rank.
  absl::Status CommitLastStep(int64_t step);
  // Between steps: brings every shard restarted from its checkpoint since
  // the last step to this one (ShardRecovery::CatchUpBetweenSteps), and
  // where that replayed the last step, sends its commit again (rank 0, or
  // every rank in an elastic job, as Finish does).
  absl::Status CatchUpShards();
  // ReloadModel after the first step, the host's x current.
  absl::Status ReplaceModel();
  // The shards hold this worker's x at its step (weights changed), the
  // host's x current (SyncHost): the pushes of the next step that
  // exchanges show it (x_hash_step_, shown_x_).
  void ShowXAtNextExchange();
  // ReloadModel on a rank but 0: waits, up to the connect timeout, until
  // the shards hold this worker's x at its step (rank 0 gives it them);
  // the step's pushes then carry x's hash. Stops the job otherwise.
  absl::Status AwaitShardsX();
  // The shards' model into replica_ once every partition is at the same
  // step (retried up to the connect timeout): the step.
  absl::StatusOr<int64_t> FetchSteadyModel();
  // Keeps the step's absent ranks (absent()), saying so when this worker's
  // own push was left out.
  void NoteAbsent(std::map<uint32_t, std::vector<uint32_t>> absent);
  // The ranks in every partition's average of the last step (member), or
  // the others.
  std::vector<uint32_t> RanksWhere(bool member) const;

  proto::JobSpec job_;
  uint32_t rank_;
  compress::Layout layout_;
  compress::Replica replica_;
  compress::ErrorFeedback error_;
  std::unique_ptr<PushClient> client_;
  // The compute pool (Connect's compute_threads; a device engine's
  // completions start one): the exchange's encodes and reply applies and
  // the optimizer's passes over the model between exchanges. Destroyed
  // after the exchange and the engine that use it, before the client.
  std::unique_ptr<compress::ComputePool> pool_;
  int64_t step_ = 0;
  // The step whose pushes carry x's hash (PushRequest.x_hash): 0, or the
  // first step that exchanges after weights were changed (ReloadModel).
  int64_t x_hash_step_ = 0;
  // The x those pushes show where it is not x then: the weights changed
  // before a zero_one_adam interval, its anchor (empty otherwise).
  std::vector<float> shown_x_;
  // The step in flight (between Begin and Finish).
  compress::StepPlan plan_;
  std::vector<compress::StepHyper> hyper_;  // see SetStepHyper
  std::string buffers_;                     // rank 0: sent with the next step
  std::string received_buffers_;  // from the last step's reply of partition 0
  compress::Absent absent_;       // of the last step's replies
  // The run of steps that left this worker out, told when it begins and
  // when it ends (a straggler may be left out of many in a row).
  int64_t left_out_from_ = -1;
  int64_t left_out_steps_ = 0;
  bool defer_apply_ = false;
  std::vector<compress::StepHyper> step_hyper_;  // the step in flight's
  // zero_one_adam's sync: each segment's lr becomes its interval's sum.
  void SetSyncLr(absl::Span<const float> lr_sums);
  // The step's replies kept for Finish when deferred (or when the step
  // clips the averaged gradient, which needs every reply's norm first), by
  // partition, with the shard's sum of squares of each.
  struct DeferredReply {
    std::string payload;  // empty when staged
    ReplyExtras extras;
    bool staged = false;  // in the engine (Engine::StageReply)
  };
  std::shared_ptr<std::vector<std::optional<DeferredReply>>> deferred_;
  // Gradient clipping (compress::ClipsAverage / ClipsLocally) of the step
  // in flight; this worker's own clip factor once its whole gradient is in.
  bool clips_average_ = false;
  bool clips_locally_ = false;
  std::optional<float> local_scale_;
  // SetStepClipping's, for steps to come; the step in flight's (its max_norm,
  // the job's clip_grad_norm unless ClipAt set one, and whether it did).
  bool clip_at_step_ = false;
  bool workers_clip_ = false;
  float max_norm_ = 0.0f;
  bool clipped_ = false;
  std::optional<double> own_sum_of_squares_;  // OwnSumOfSquares
  // SendAndWait's outcome and traffic, once it ran in the step in flight.
  std::optional<absl::Status> waited_;
  StepTraffic waited_traffic_;
  // The last step's sum of squares of the averaged gradient, if it clipped:
  // sent with the next step's pushes (morse.proto Commit).
  std::optional<double> previous_grad_sum_of_squares_;
  std::optional<float> previous_clip_max_norm_;  // when the workers chose it
  compress::ClipPieces clip_pieces_;             // ClipPiecesAt, this step
  compress::ClipPieces previous_clip_pieces_;
  // AmendAt's gradient of this step (empty: none), and the last step's,
  // which its commit and the next step's pushes carry.
  std::vector<float> amended_;
  std::shared_ptr<const std::vector<float>> previous_amended_;
  // onebit_lamb: the last step's commit, likewise.
  std::vector<double> previous_commit_;
  std::vector<bool> sent_;
  // zero_one_adam's local phase: the step in flight waits for Finish to
  // take its local step (and only then exchanges, if it syncs).
  bool local_pending_ = false;
  std::unique_ptr<StepExchange> exchange_;
  std::unique_ptr<Engine> engine_;  // replaced between steps only
  absl::Status failed_;  // the error that ended training, if a step failed
  int64_t trace_step_start_ = -1;  // the step's start on the trace's clock
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_SESSION_H_
