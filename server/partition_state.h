// ShardCore's partitions, shared by its files (shard_core.cc: pushes,
// commits, the mirror; shard_checkpoint.cc: checkpoints). Internal to
// server/.
#ifndef MORSE_SERVER_PARTITION_STATE_H_
#define MORSE_SERVER_PARTITION_STATE_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "compress/optimizer.h"
#include "server/shard_core.h"

namespace morse::server {

struct ShardCore::PartitionState {
  explicit PartitionState(const compress::Partition& p, uint32_t workers)
      : partition(p),
        pushes(workers),
        push_hashes(workers, 0),
        live(workers, true),
        live_count(workers),
        last_hashes(workers, 0) {}

  const compress::Partition partition;
  Mutex mu;
  bool initialized ABSL_GUARDED_BY(mu) = false;
  int64_t next_step ABSL_GUARDED_BY(mu) = 0;  // steps completed
  // The pending step next_step:
  std::vector<std::optional<std::string>> pushes ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> push_hashes ABSL_GUARDED_BY(mu);  // BytesHash of each
  uint32_t arrived ABSL_GUARDED_BY(mu) = 0;
  absl::Time first_arrival ABSL_GUARDED_BY(mu);
  // When arrived reached min_workers (timeouts.straggler_seconds count from
  // there).
  absl::Time quorum_arrival ABSL_GUARDED_BY(mu);
  // The membership (design.md 4, "Membership"): the ranks whose pushes a step
  // waits for. Every rank at first; an elastic job's ExpireWaiting takes out
  // the ones a step completed without, and any push of theirs puts them back
  // (one of a completed step: the step in flight then waits for them).
  std::vector<bool> live ABSL_GUARDED_BY(mu);
  uint32_t live_count ABSL_GUARDED_BY(mu);
  // The step's lr and weight decay as the first push carried them (every
  // other push must carry the same), and that push's rank.
  std::optional<compress::StepHyper> hyper ABSL_GUARDED_BY(mu);
  uint32_t hyper_rank ABSL_GUARDED_BY(mu) = 0;
  std::string buffers ABSL_GUARDED_BY(mu);  // rank 0's, for the reply
  std::vector<std::pair<uint32_t, ReplyCallback>> waiters ABSL_GUARDED_BY(mu);
  // Every push is in and the step's completion is scheduled on the pool.
  bool completing ABSL_GUARDED_BY(mu) = false;
  // Since when its completion has been held for an observer
  // (ShardCore::HoldForObservers; the step trace's "held"), or -1.
  int64_t held_since_us ABSL_GUARDED_BY(mu) = -1;
  // The last completed step, next_step - 1:
  std::shared_ptr<const Reply> last_reply ABSL_GUARDED_BY(mu);
  // Its mirror update, when not applied yet: replies go out first, and the
  // mirror catches up right after, or when something reads it first
  // (ApplyMirror).
  bool mirror_pending ABSL_GUARDED_BY(mu) = false;
  // onebit_lamb: the mirror took that reply's moments as it went out (for
  // its layer statistics, Reply::piece_stats); the commit moves x alone.
  bool mirror_moments_applied ABSL_GUARDED_BY(mu) = false;
  std::optional<compress::StepHyper> mirror_hyper ABSL_GUARDED_BY(mu);
  // Gradient clipping of the last completed step (compress::ClipsAverage):
  // the mirror waits for the whole model's sum of squares (Commit), then
  // applies the step scaled by its clip factor. onebit_lamb: every step's
  // mirror waits for the layers' coefficients (CommitValues).
  bool awaiting_commit ABSL_GUARDED_BY(mu) = false;
  std::optional<double> committed_norm
      ABSL_GUARDED_BY(mu);  // the sum of squares
  std::optional<float> committed_max_norm ABSL_GUARDED_BY(mu);
  // The pushes of the step in flight said workers_clip (the first one's
  // word; the others must agree), and those of the last completed step.
  bool workers_clip ABSL_GUARDED_BY(mu) = false;
  bool last_workers_clip ABSL_GUARDED_BY(mu) = false;
  // The last completed step came from a checkpoint (or RestorePartition),
  // its commit applied before it was written: how it clipped is not known
  // here, and a commit of it that the next pushes carry is taken as
  // applied, unchecked, as for older steps.
  bool last_step_restored ABSL_GUARDED_BY(mu) = false;
  float mirror_scale ABSL_GUARDED_BY(mu) = 1.0f;
  // A clip of part of the model (its commit's pieces, the whole model's),
  // or empty.
  compress::ClipPieces committed_pieces ABSL_GUARDED_BY(mu);
  std::vector<double> committed_values ABSL_GUARDED_BY(mu);
  // The gradient the workers amended the last completed step to over this
  // partition (StepCommit::amended; fp32 bytes), until the mirror applies
  // it in place of the reply; with its hash, kept until the next step
  // completes, that later commits of the step must match (none: not
  // amended).
  std::string committed_amendment ABSL_GUARDED_BY(mu);
  std::optional<uint64_t> committed_amendment_hash ABSL_GUARDED_BY(mu);
  // The optimizer's arrays that are not per element (onebit_lamb's layer
  // state), in State()'s order, after the partition's last applied commit
  // (Optimizer::StateAfterCommit). Each partition keeps its own: the
  // commits are the whole model's, the same for every partition of a step,
  // but partitions apply them from different threads and may be a step
  // apart, and a snapshot of one partition holds the state of its step.
  std::vector<std::vector<float>> whole_state ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> last_hashes ABSL_GUARDED_BY(mu);
  // The completed steps before the last one, oldest first, each with its
  // reply and the hashes of the pushes it answered (none for the ranks it
  // left out, Reply::absent): a restarted worker
  // replays from its checkpoint's step and gets these replies again
  // (checkpoint.replay_steps in all, the last one included).
  struct Answered {
    std::shared_ptr<const Reply> reply;
    std::vector<uint64_t> hashes;
  };
  std::deque<Answered> history ABSL_GUARDED_BY(mu);
  // Restored by RestorePartition and not stepped since: may be restored again.
  bool restored ABSL_GUARDED_BY(mu) = false;
  // The step whose pushes must carry the hash of x: x was replaced after
  // step x_replaced_after (ShardCore::ReplaceX), and this is the first
  // step that exchanges since (zero_one_adam's local steps do not); -1 for
  // none.
  int64_t x_replaced_step ABSL_GUARDED_BY(mu) = -1;
  int64_t x_replaced_after ABSL_GUARDED_BY(mu) = -2;
  uint64_t x_replaced_hash ABSL_GUARDED_BY(mu) = 0;  // compress::XHash of it

  // Forgets the pending step's pushes (completed, expired or aborted).
  void ClearPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& push : pushes) push.reset();
    arrived = 0;
    completing = false;
    held_since_us = -1;
    hyper.reset();
    workers_clip = false;
    buffers.clear();
  }
};

// The step completed without this rank (membership, design.md 4, "Membership"):
// its push came late or not at all, and any bytes get the reply.
inline bool LeftOut(const Reply& reply, uint32_t rank) {
  return std::binary_search(reply.absent.begin(), reply.absent.end(), rank);
}

// The values of the optimizer's arrays that are not per element, in
// State()'s order, from a whole state (CheckState'd).
std::vector<std::vector<float>> WholeArrays(
    const proto::JobSpec& job, absl::Span<const compress::NamedState> state);

}  // namespace morse::server

#endif  // MORSE_SERVER_PARTITION_STATE_H_
