#include "server/shard_host.h"

#include "absl/strings/str_cat.h"
#include "compress/algorithm.h"
#include "compress/optimizer.h"
#include "compress/replica.h"

namespace morse::server {

absl::StatusOr<std::unique_ptr<ShardHost>> ShardHost::Create(
    const proto::JobSpec& base, uint32_t shard, OnConfigured on_configured,
    uint64_t max_model_elems, int compute_threads) {
  if (shard >= base.shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", shard, " does not exist; the job has ",
                     base.shards(), " shards (0..", base.shards() - 1, ")"));
  }
  std::unique_ptr<ShardHost> host(new ShardHost(
      base, shard, std::move(on_configured), max_model_elems, compute_threads));
  if (base.sized()) {
    MutexLock lock(&host->mu_);
    if (absl::Status s = host->Configure(base, false); !s.ok()) return s;
  }
  return host;
}

absl::Status ShardHost::Configure(const proto::JobSpec& job, bool relaid) {
  auto core = ShardCore::Create(job, shard_, proto::HostMemoryBytes(),
                                compute_threads_);
  if (core.status().code() == absl::StatusCode::kResourceExhausted)
    return core.status();
  if (!core.ok()) return absl::FailedPreconditionError(core.status().message());
  if (on_configured_) {
    if (absl::Status s = on_configured_(job, **core, relaid); !s.ok()) return s;
  }
  job_ = job;
  owned_ = std::shared_ptr<ShardCore>(*std::move(core));
  MutexLock lock(&core_mu_);
  core_ = owned_;  // an earlier layout's core goes with its last caller
  return absl::OkStatus();
}

absl::Status ShardHost::JoinNext(uint32_t rank, const proto::JobSpec& job) {
  const uint32_t now = job_.external.generation;
  const uint32_t theirs = job.external.generation;
  if (theirs != now + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " brings layout generation ", theirs,
        " but the shard serves generation ", now,
        theirs < now ? " (the others laid the model out anew since: every "
                       "rank must call add_param_group at the same step)"
                     : ""));
  }
  if (compress::OptimizerOf(job.algorithm).kind() !=
          compress::OptimizerOf(job_.algorithm).kind() ||
      job.algorithm.lr.kind != job_.algorithm.lr.kind) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank,
                     " lays the model out anew with another optimizer or "
                     "schedule than the job's"));
  }
  if (next_.has_value() &&
      (job.algorithm.layout.dim != next_->algorithm.layout.dim ||
       job.external.shapes_fingerprint != next_->external.shapes_fingerprint ||
       compress::AlgorithmFingerprint(job.algorithm) !=
           compress::AlgorithmFingerprint(next_->algorithm))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " lays the model out anew as ", job.algorithm.layout.dim,
        " parameters, another rank as ", next_->algorithm.layout.dim,
        " (or with other shapes or settings): every rank must add the same "
        "parameter groups"));
  }
  if (!next_.has_value()) {
    next_ = job;
    joined_next_.assign(base_.workers(), false);
  }
  joined_next_[rank] = true;
  // Every worker lays it out; in an elastic job, every rank still in the
  // membership of some partition, and rank 0, which restores the new core
  // (design.md 4, "A new layout mid-job").
  const std::vector<bool> members =
      job_.elastic() ? owned_->InSomeMembership()
                     : std::vector<bool>(base_.workers(), true);
  for (uint32_t r = 0; r < base_.workers(); ++r) {
    if (!joined_next_[r] && (members[r] || r == 0)) {
      return absl::OkStatus();  // the last one awaited lays it out
    }
  }
  const std::shared_ptr<ShardCore> old = owned_;
  if (absl::Status s = Configure(*next_, /*relaid=*/true); !s.ok()) {
    return s;
  }
  // The ranks that had left are left out of the new layout's steps, and
  // cannot join it: their state is of the old layout.
  left_relaid_ = joined_next_;
  left_relaid_.flip();
  owned_->SetMembership(joined_next_);
  // Anything still waiting on the old layout (nothing should: every worker
  // is between steps) is answered now, and anything later at once.
  old->Stop(absl::FailedPreconditionError(absl::StrCat(
      "the job's model was laid out anew (generation ",
      job_.external.generation, "); this call was of the old layout")));
  next_.reset();
  joined_.assign(base_.workers(), true);
  joined_next_.clear();
  return absl::OkStatus();
}

absl::Status ShardHost::Join(uint32_t rank, const proto::JobSpec& job) {
  if (rank >= base_.workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown rank ", rank, "; the job has ", base_.workers(), " workers"));
  }
  const auto differs = [](absl::string_view what, auto mine, auto theirs) {
    return absl::FailedPreconditionError(
        absl::StrCat("this worker's job differs from the shard's: ", what, " ",
                     theirs, " vs ", mine));
  };
  if (job.workers() != base_.workers())
    return differs("workers", base_.workers(), job.workers());
  if (job.shards() != base_.shards())
    return differs("shards", base_.shards(), job.shards());
  if (!job.sized()) {
    return absl::InvalidArgumentError(
        "a joining worker must say the model's size (external.dim)");
  }
  if (max_model_elems_ > 0 && job.algorithm.layout.dim > max_model_elems_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", rank, " brings a model of ", job.algorithm.layout.dim,
        " elements; this server takes at most ", max_model_elems_,
        " (--max_model_elems)"));
  }
  MutexLock lock(&mu_);
  if (owned_ != nullptr &&
      job.external.generation != job_.external.generation) {
    return JoinNext(rank, job);
  }
  if (owned_ == nullptr) {
    if (absl::Status s = Configure(job, false); !s.ok()) return s;
  } else if (!left_relaid_.empty() && left_relaid_[rank]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank,
        " had left this elastic job when the others laid its model out anew "
        "(layout generation ",
        job_.external.generation,
        ", add_param_group): its state is of the old layout, so it cannot "
        "join; the job goes on without it"));
  } else {
    if (job.algorithm.layout.dim != job_.algorithm.layout.dim ||
        job.external.shapes_fingerprint != job_.external.shapes_fingerprint) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, " registered ", job.algorithm.layout.dim,
                       " parameters",
                       job.external.shapes.empty()
                           ? ""
                           : absl::StrCat(" shaped ", job.external.shapes),
                       " but the job has ", job_.algorithm.layout.dim,
                       job_.external.shapes.empty()
                           ? ""
                           : absl::StrCat(" shaped ", job_.external.shapes),
                       "; every worker must build the same model"));
    }
    if (owned_->layout().fingerprint() !=
        compress::Layout::Create(job.algorithm.layout)->fingerprint()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank,
          " has a different layout (block_elems or partition_elems)"));
    }
    if (compress::AlgorithmFingerprint(job.algorithm) !=
        compress::AlgorithmFingerprint(job_.algorithm)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank,
                       " has different optimizer settings (optimizer, betas, "
                       "eps, weight decay, "
                       "freeze_step, clip_grad_norm, codecs, feedback, seed or "
                       "onebit_lamb's layers) from the job's"));
    }
    const compress::LrSchedule& a = job.algorithm.lr;
    const compress::LrSchedule& b = job_.algorithm.lr;
    if (a.kind != b.kind || a.base_lr != b.base_lr ||
        a.warmup_steps != b.warmup_steps || a.total_steps != b.total_steps ||
        a.min_lr != b.min_lr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " has a different learning-rate schedule (lr ",
          a.base_lr, " vs ", b.base_lr,
          "); the shards' mirrors would drift from the workers"));
    }
  }
  joined_[rank] = true;
  owned_->ClearAbort();  // a worker (re)joining restarts a stopped job
  return absl::OkStatus();
}

uint32_t ShardHost::generation() const {
  MutexLock lock(&mu_);
  return job_.external.generation;
}

uint32_t ShardHost::workers_joined_next() const {
  MutexLock lock(&mu_);
  uint32_t n = 0;
  for (bool j : joined_next_) n += j;
  return n;
}

uint32_t ShardHost::workers_joined() const {
  MutexLock lock(&mu_);
  uint32_t n = 0;
  for (bool j : joined_) n += j;
  return n;
}

}  // namespace morse::server
