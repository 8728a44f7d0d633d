// ShardHost: one shard's process-level state — the base job config from the
// command line, the ShardCore once the model's size is known, and which
// ranks have joined. For built-in workloads the core exists from the start;
// for external models (PyTorch) the first worker's Join brings the size and
// the optimizer's settings, and every other worker must bring the same.
// An external model laid out anew (ExternalModel.generation g + 1, from
// add_param_group) replaces the core once every worker has joined with it:
// a fresh core of the new layout, which rank 0 then restores (design.md 4,
// "A new layout mid-job").
//
// Thread-safe. core() is null until configured; a core it returned stays
// alive while the caller holds it (one replaced by a new layout is freed
// when the last call that took it ends).
#ifndef MORSE_SERVER_SHARD_HOST_H_
#define MORSE_SERVER_SHARD_HOST_H_

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "server/shard_core.h"

namespace morse::server {

class ShardHost {
 public:
  // Called once with each new core before any worker can use it (restore a
  // checkpoint, set the step observer); `relaid`: it replaces a core of an
  // earlier layout (nothing on disk is its state). An error fails the Join
  // that configured it, and the shard keeps what it had.
  using OnConfigured = std::function<absl::Status(
      const proto::JobSpec& job, ShardCore& core, bool relaid)>;

  // For a sized base config, creates the core now (and runs on_configured).
  // max_model_elems (0: no limit but the host's memory) caps the model an
  // external job's first Join may size the shard for. compute_threads:
  // the core's compute pool (ShardCore::Create; 0: none).
  static absl::StatusOr<std::unique_ptr<ShardHost>> Create(
      const proto::JobSpec& base, uint32_t shard, OnConfigured on_configured,
      uint64_t max_model_elems = 0, int compute_threads = 0);

  // Registers `rank` with the job it loaded. FAILED_PRECONDITION if that job
  // differs from this shard's (workers, shards, model size or shapes, layout
  // or algorithm), saying how; INVALID_ARGUMENT for an unknown rank;
  // RESOURCE_EXHAUSTED for a model above max_model_elems or the host's
  // memory (nothing is allocated then). A successful Join clears an abort
  // (ShardCore::Abort): the job is restarting. A Join of the next layout
  // generation is taken (OK) and counted until every worker has made one
  // alike (in an elastic job: every rank in some partition's membership,
  // and rank 0); the last makes the new core, whose membership is the ranks
  // that joined it. One of an older generation, or of a next one that
  // differs from another worker's, is FAILED_PRECONDITION, and so is a Join
  // from a rank that had left an elastic job when its layout was made.
  absl::Status Join(uint32_t rank, const proto::JobSpec& job);

  std::shared_ptr<ShardCore> core() const {
    MutexLock lock(&core_mu_);
    return core_;
  }
  uint32_t workers_joined() const;
  // The layout generation served, and the workers that joined the next.
  uint32_t generation() const;
  uint32_t workers_joined_next() const;
  uint32_t shard() const { return shard_; }
  const proto::JobSpec& base() const { return base_; }

 private:
  ShardHost(const proto::JobSpec& base, uint32_t shard,
            OnConfigured on_configured, uint64_t max_model_elems,
            int compute_threads)
      : base_(base),
        shard_(shard),
        max_model_elems_(max_model_elems),
        compute_threads_(compute_threads),
        on_configured_(std::move(on_configured)),
        joined_(base.workers()) {}
  absl::Status Configure(const proto::JobSpec& job, bool relaid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status JoinNext(uint32_t rank, const proto::JobSpec& job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const proto::JobSpec base_;
  const uint32_t shard_;
  const uint64_t max_model_elems_;
  const int compute_threads_;
  OnConfigured on_configured_;
  mutable Mutex mu_;
  std::shared_ptr<ShardCore> owned_ ABSL_GUARDED_BY(mu_);
  // owned_, for calls that take it without waiting on a Join.
  mutable Mutex core_mu_;
  std::shared_ptr<ShardCore> core_ ABSL_GUARDED_BY(core_mu_);
  proto::JobSpec job_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> joined_ ABSL_GUARDED_BY(mu_);
  // The next layout, while some workers have joined with it.
  std::optional<proto::JobSpec> next_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> joined_next_ ABSL_GUARDED_BY(mu_);
  // An elastic job's ranks that had left when the layout served was made
  // (none joined it); empty before any new layout.
  std::vector<bool> left_relaid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace morse::server

#endif  // MORSE_SERVER_SHARD_HOST_H_
