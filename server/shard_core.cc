#include "server/shard_core.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "compress/bytes_hash.h"
#include "compress/check.h"
#include "compress/layers.h"
#include "compress/messages.h"
#include "compress/optimizer.h"
#include "compress/scratch.h"
#include "compress/trace.h"
#include "proto/checkpoint_file.h"
#include "server/partition_state.h"

namespace morse::server {
namespace {

// The values `commit` amends `partition` to (StepCommit::amended), or null.
const std::string* AmendmentOf(const StepCommit& commit, uint32_t partition) {
  for (const auto& [id, values] : commit.amended) {
    if (id == partition) return &values;
  }
  return nullptr;
}

}  // namespace

using compress::CodecName;

absl::StatusOr<std::unique_ptr<ShardCore>> ShardCore::Create(
    const proto::JobSpec& job, uint32_t shard, uint64_t memory_limit,
    int compute_threads) {
  if (compute_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute threads: ", compute_threads,
                     "; at least 0 (0: none, complete inline)"));
  }
  auto layout = compress::Layout::Create(job.algorithm.layout);
  if (!layout.ok()) return layout.status();
  if (shard >= job.shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", shard, " does not exist; the job has ",
                     job.shards(), " shards (0..", job.shards() - 1, ")"));
  }
  const uint64_t elems = layout->shard_range(shard).size();
  if (absl::Status s = proto::CheckFitsInMemory(
          proto::ShardStateBytes(job, elems),
          absl::StrCat("shard ", shard, " (", elems, " of the model's ",
                       job.algorithm.layout.dim, " elements)"),
          memory_limit);
      !s.ok()) {
    return s;
  }
  auto core =
      std::unique_ptr<ShardCore>(new ShardCore(job, shard, *std::move(layout)));
  if (compute_threads > 0)
    core->pool_ = std::make_unique<compress::ComputePool>(compute_threads);
  return core;
}

std::vector<std::vector<float>> WholeArrays(
    const proto::JobSpec& job, absl::Span<const compress::NamedState> state) {
  const std::vector<compress::StateArray> arrays =
      compress::OptimizerOf(job.algorithm).State(job.algorithm);
  std::vector<std::vector<float>> whole;
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (!arrays[i].per_element) whole.push_back(state[i].values);
  }
  return whole;
}

ShardCore::ShardCore(const proto::JobSpec& job, uint32_t shard,
                     compress::Layout layout)
    : job_(job),
      shard_(shard),
      layout_(std::move(layout)),
      range_(layout_.shard_range(shard)),
      mirror_(job.algorithm, range_),
      server_error_(job.algorithm.server_feedback, range_.size(),
                    job.algorithm.layout.block_elems) {
  // The optimizer's arrays that are not per element, as every partition
  // starts with them.
  const compress::Optimizer& optimizer = compress::OptimizerOf(job.algorithm);
  std::vector<std::vector<float>> initial;
  for (const compress::StateArray& array : optimizer.State(job.algorithm)) {
    if (!array.per_element)
      initial.push_back(optimizer.InitialState(job.algorithm, array));
  }
  for (const compress::Partition& p : layout_.shard_partitions(shard)) {
    partitions_.push_back(std::make_unique<PartitionState>(p, job.workers()));
    partitions_.back()->whole_state = initial;
  }
}

ShardCore::~ShardCore() {
  // Completes what is scheduled while the partitions exist. Stop, not
  // reset: the tasks it runs read pool_ (MirrorSoon) meanwhile.
  if (pool_ != nullptr) pool_->Stop();
}

absl::Status ShardCore::CheckCommon(uint32_t rank, uint32_t partition,
                                    uint64_t fingerprint) const {
  if (fingerprint != layout_.fingerprint()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout fingerprint ", absl::Hex(fingerprint),
        " differs from this shard's ", absl::Hex(layout_.fingerprint()),
        "; worker and server configs disagree on D, S, "
        "block_elems or partition_elems"));
  }
  if (rank >= job_.workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown rank ", rank, "; the job has ", job_.workers(), " workers"));
  }
  const auto owned = layout_.shard_partitions(shard_);
  if (partition < owned.front().id || partition > owned.back().id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition ", partition, " is not on shard ", shard_, " (it holds ",
        owned.front().id, "..", owned.back().id, ")"));
  }
  return absl::OkStatus();
}

absl::Status ShardCore::InitPartition(uint32_t rank, uint32_t partition,
                                      uint64_t fingerprint,
                                      absl::string_view values) {
  if (absl::Status s = CheckCommon(rank, partition, fingerprint); !s.ok())
    return s;
  if (rank != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "only rank 0 uploads initial parameters, not rank ", rank));
  }
  PartitionState& p =
      *partitions_[partition - layout_.shard_partitions(shard_).front().id];
  const uint64_t n = p.partition.range.size();
  if (values.size() != 4 * n) {
    return absl::InvalidArgumentError(
        absl::StrCat("initial values of partition ", partition, ": ",
                     values.size(), " bytes for ", n, " fp32 elements"));
  }
  for (uint64_t j = 0; j < n; ++j) {
    float f;
    std::memcpy(&f, values.data() + 4 * j, 4);
    if (!std::isfinite(f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial value ", j, " of partition ", partition, " is not finite"));
    }
  }
  MutexLock lock(&p.mu);
  auto x = mirror_.x().subspan(p.partition.range.begin - range_.begin, n);
  if (p.initialized) {
    if (std::memcmp(x.data(), values.data(), 4 * n) == 0)
      return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "partition ", partition, " already holds different initial values",
        p.next_step > 0 ? " and training has started" : ""));
  }
  std::memcpy(x.data(), values.data(), 4 * n);
  p.initialized = true;
  MutexLock progress(&progress_mu_);
  ++initialized_;
  return absl::OkStatus();
}

absl::Status ShardCore::CheckPushArgs(const PushArgs& args) const {
  if (absl::Status s =
          CheckCommon(args.rank, args.partition, args.layout_fingerprint);
      !s.ok()) {
    return s;
  }
  if (args.step < 0) return absl::InvalidArgumentError("negative step");
  if (!args.buffers.empty() && (args.rank != 0 || args.partition != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", args.rank, " sent module buffers with partition ",
        args.partition, "; only rank 0 sends them, with partition 0"));
  }
  if (args.buffers.size() > proto::kMaxBufferBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("module buffers of ", args.buffers.size(),
                     " bytes; at most ", proto::kMaxBufferBytes));
  }
  if (args.replay_absent.has_value()) {
    if (!compress::ValidAbsent(*args.replay_absent, job_.workers())) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", args.rank,
                       "'s replayed push: replay_absent is not distinct "
                       "ranks of the job, ascending, with one left in"));
    }
  }
  if (args.hyper.has_value()) {
    absl::Status s = compress::CheckStepHyper(job_.algorithm, *args.hyper);
    if (s.ok()) s = compress::CheckHyperAtStep(*args.hyper, args.step);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", args.rank, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

namespace {

// A push of the first step that exchanges after rank 0 replaced x
// (ShardCore::ReplaceX) shows the hash of that x (PushArgs::x_hash): OK, or
// FAILED_PRECONDITION saying how it differs. `left_out`: the step completed
// without the rank.
// `after`: the step rank 0 changed them after.
absl::Status ShowsReplacedX(const PushArgs& args, uint64_t hash, int64_t after,
                            bool left_out) {
  const std::string which = left_out ? " (a step completed without it)" : "";
  if (!args.x_hash.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank 0 changed the weights after step ", after, " and rank ",
        args.rank, " did not (its push of partition ", args.partition,
        " at step ", args.step, which,
        " was computed from the old ones): change the weights the same way "
        "on every rank"));
  }
  if (*args.x_hash != hash) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", args.rank, "'s parameters in partition ",
                     args.partition, " at step ", args.step, which,
                     " are not the ones rank 0 changed them to after step ",
                     after, ": change the weights the same way on every rank"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Reply>> ShardCore::KeptReply(
    const PartitionState& p, const PushArgs& args, uint64_t hash) const {
  if (args.step == p.next_step - 1) {  // a retry of the completed step
    if (p.last_reply == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", args.step, " of partition ", args.partition,
                       " was completed before this server restarted from its "
                       "checkpoint; its reply is gone"));
    }
    if (LeftOut(*p.last_reply, args.rank)) {
      if (absl::Status s = CheckLeftOutX(p, args); !s.ok()) return s;
    } else if (hash != p.last_hashes[args.rank]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", args.rank, " re-sent step ", args.step, " of partition ",
          args.partition, " with different bytes"));
    }
    return p.last_reply;
  }
  // A restarted worker replaying from its checkpoint (DESIGN 4): the reply
  // it had, if its push is the one it sent then.
  const auto answered = std::find_if(p.history.begin(), p.history.end(),
                                     [&](const PartitionState::Answered& a) {
                                       return a.reply->step == args.step;
                                     });
  if (answered == p.history.end()) {
    absl::Status stale = absl::FailedPreconditionError(absl::StrCat(
        "step ", args.step, " of partition ", args.partition,
        " is stale; the partition has completed ", p.next_step,
        " steps and accepts step ", p.next_step,
        p.history.empty()
            ? std::string()
            : absl::StrCat(
                  " (it keeps the replies of steps ",
                  p.history.front().reply->step,
                  " on for restarted workers: checkpoint.replay_steps)"),
        p.live[args.rank]
            ? std::string()
            : absl::StrCat("; rank ", args.rank,
                           " was left out of the membership (min_workers) and "
                           "is too far behind to catch up: restart it "
                           "(morse-worker --rejoin, a morse.torch rank under "
                           "morse-run --rank-restarts); it joins from its "
                           "checkpoint, or the shards' model, at their step")));
    // A worker replaying to help a restarted shard learns it is past that.
    stale.SetPayload(kNextStepPayload,
                     absl::Cord(absl::StrCat(NextExchange(p))));
    return stale;
  }
  if (LeftOut(*answered->reply, args.rank)) {
    if (absl::Status s = CheckLeftOutX(p, args); !s.ok()) return s;
  } else if (hash != answered->hashes[args.rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", args.rank, " replayed step ", args.step,
                     " of partition ", args.partition,
                     " with other bytes than it pushed then: its "
                     "checkpoint, data or command line differ "
                     "from the run's"));
  }
  return answered->reply;
}

absl::Status ShardCore::CheckLeftOutX(const PartitionState& p,
                                      const PushArgs& args) const {
  if (args.step != p.x_replaced_step) return absl::OkStatus();
  return ShowsReplacedX(args, p.x_replaced_hash, p.x_replaced_after,
                        /*left_out=*/true);
}

absl::Status ShardCore::CheckCurrentPush(const PartitionState& p,
                                         PushArgs& args, StepCommit* carried,
                                         bool* commits) const {
  if (args.step < NextExchange(p)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", args.step,
        " is a local step of zero_one_adam (docs/design.md 2.7): workers do "
        "not push; partition ",
        args.partition, " accepts step ", NextExchange(p), " next"));
  }
  if (args.step > NextExchange(p)) {
    // A shard restored from its checkpoint is behind its workers: they
    // replay their retained pushes from the step it accepts on (DESIGN 4).
    const int64_t accepts = NextExchange(p);
    absl::Status behind = absl::AbortedError(
        absl::StrCat("step ", args.step, " of partition ", args.partition,
                     " is too far ahead; the partition has completed ",
                     p.next_step, " steps and accepts step ", accepts));
    behind.SetPayload(kNextStepPayload, absl::Cord(absl::StrCat(accepts)));
    return behind;
  }
  const compress::StepPlan plan = compress::PlanStep(job_.algorithm, args.step);
  if (args.codec != plan.up.kind) {
    return absl::FailedPreconditionError(absl::StrCat(
        "codec ", CodecName(args.codec), " is not allowed at step ", args.step,
        " (", compress::PhaseName(job_.algorithm, args.step),
        " phase); expected ", CodecName(plan.up.kind)));
  }
  const uint64_t n = p.partition.range.size();
  const bool idle =
      compress::Idle(job_.algorithm, args.step, p.partition.range.begin);
  if (absl::Status s =
          idle ? (args.payload.empty()
                      ? absl::OkStatus()
                      : absl::InvalidArgumentError(absl::StrCat(
                            args.payload.size(),
                            " bytes for a partition that sits this step out "
                            "(diloco.fragments): expected none")))
               : compress::ValidatePayload(
                     plan.up,
                     {reinterpret_cast<const uint8_t*>(args.payload.data()),
                      args.payload.size()},
                     n);
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", args.rank, " partition ", args.partition,
                     " step ", args.step, ": ", s.message()));
  }
  const auto& same = compress::SameStepHyper;
  const auto& describe = compress::DescribeStepHyper;
  *commits = false;
  *carried = StepCommit{
      args.previous_grad_sum_of_squares, args.previous_clip_max_norm,
      std::move(args.previous_commit), std::move(args.previous_clip_pieces)};
  if (!args.previous_amended.empty()) {
    carried->amended.emplace_back(args.partition,
                                  std::move(args.previous_amended));
  }
  if (carried->grad_sum_of_squares.has_value() || !carried->values.empty()) {
    if (absl::Status s =
            CheckCommit(p, args.rank, args.step - 1, *carried, commits);
        !s.ok()) {
      return s;
    }
  } else if (p.awaiting_commit) {
    return absl::FailedPreconditionError(
        p.committed_values.empty() && compress::CommitsLayers(job_.algorithm)
            ? absl::StrCat("step ", args.step - 1, " of partition ",
                           args.partition, " waits for ",
                           compress::OptimizerOf(job_.algorithm).name(),
                           "'s commit: rank ", args.rank, "'s push of step ",
                           args.step, " must carry it (previous_commit)")
            : absl::StrCat(
                  "step ", args.step - 1, " of partition ", args.partition,
                  " clipped the averaged gradient (clip_grad_norm) and its "
                  "sum of squares "
                  "has not arrived: rank ",
                  args.rank, "'s push of step ", args.step,
                  " must carry it (previous_grad_sum_of_squares)"));
  }
  if (p.arrived > 0 && p.workers_clip != args.workers_clip) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", args.rank, "'s push of step ", args.step, " says the ",
        "workers ", args.workers_clip ? "clip" : "do not clip",
        " its averaged gradient (clip_grad_norm_ after backward()), rank ",
        p.hyper_rank, "'s says they ", p.workers_clip ? "do" : "do not",
        "; every worker must call clip_grad_norm_ alike"));
  }
  if (args.workers_clip && job_.algorithm.clip_grad_norm > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", args.rank, " clips step ", args.step,
        " by a max_norm of its own, but the job clips by clip_grad_norm ",
        job_.algorithm.clip_grad_norm));
  }
  // At the first step that exchanges after rank 0 replaced x (ReplaceX)
  // every push must show the model it was computed from (zero_one_adam's
  // sync: the interval's anchor).
  const bool replaced =
      p.x_replaced_step == args.step && NextExchange(p) == args.step;
  if (replaced) {
    if (absl::Status s = ShowsReplacedX(args, p.x_replaced_hash,
                                        p.x_replaced_after, /*left_out=*/false);
        !s.ok()) {
      return s;
    }
  } else if (args.x_hash.has_value() && args.step == 0 && p.next_step == 0) {
    // Before the first step the mirror's x is the job's initial model:
    // rank 0's, or what it restored (a model loaded after the optimizer
    // was built, morse.torch's reload).
    const uint64_t offset = p.partition.range.begin - range_.begin;
    if (compress::XHash(mirror_.x().subspan(
            offset, p.partition.range.size())) != *args.x_hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", args.rank, "'s parameters in partition ", args.partition,
          " are not the job's at step 0 (rank 0's): every rank must load the "
          "same weights, and load them on every rank if one does after "
          "building the optimizer"));
    }
  }
  if (p.arrived > 0 && !same(p.hyper, args.hyper)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", args.rank, " asks for ", describe(args.hyper), " at step ",
        args.step, " but rank ", p.hyper_rank, " asked for ", describe(p.hyper),
        "; every worker must use the same learning rate and "
        "weight decay each step"));
  }
  return absl::OkStatus();
}

absl::Status ShardCore::AcceptPush(PartitionState& p, PushArgs& args,
                                   uint64_t hash, ReplyCallback& done,
                                   Completion* completion, bool* schedule) {
  if (args.replay_absent.has_value()) {
    // A re-send after this shard restarted: the step had this membership
    // (design.md 4, "Membership"), and gets it again, so that its reply
    // is the one the workers applied.
    uint32_t live = 0;
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      p.live[r] = !std::binary_search(args.replay_absent->begin(),
                                      args.replay_absent->end(), r);
      if (!p.live[r] && p.pushes[r].has_value()) {  // it counts no more
        p.pushes[r].reset();
        --p.arrived;
      }
      live += p.live[r] ? 1 : 0;
    }
    p.live_count = live;
  }
  std::optional<std::string>& slot = p.pushes[args.rank];
  if (args.replay_absent.has_value() && !p.live[args.rank]) {
    // Left out of the step then: it gets the reply, and adds nothing.
  } else if (slot.has_value()) {
    if (*slot != args.payload) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", args.rank, " re-sent step ", args.step, " of partition ",
          args.partition, " with different bytes"));
    }
  } else {
    if (!p.live[args.rank]) {  // back in the membership (design.md 4,
                               // "Membership")
      p.live[args.rank] = true;
      ++p.live_count;
    }
    if (p.arrived == 0) {
      p.first_arrival = absl::Now();
      p.hyper = args.hyper;
      p.hyper_rank = args.rank;
      p.workers_clip = args.workers_clip;
    }
    slot = std::move(args.payload);
    p.push_hashes[args.rank] = hash;
    if (args.rank == 0) p.buffers = std::move(args.buffers);
    ++p.arrived;
    if (p.arrived == job_.min_workers && job_.straggler_timeout_seconds > 0) {
      // The others get straggler_seconds more (design.md 4, "Stragglers").
      p.quorum_arrival = absl::Now();
      if (p.arrived < p.live_count && wakeup_) {
        wakeup_(p.quorum_arrival +
                absl::Seconds(job_.straggler_timeout_seconds));
      }
    }
  }
  p.waiters.emplace_back(args.rank, std::move(done));
  if (p.arrived > 0 && p.arrived == p.live_count && !p.completing)
    StartCompletion(p, completion, schedule);
  return absl::OkStatus();
}

bool ShardCore::HoldForObservers(PartitionState& p) {
  // Without an observer nothing reads the shard as of a step. (A core's
  // own tests may push a partition's steps without waiting for the
  // replies, which no worker can: its next step needs them.)
  if (!observer_) return false;
  MutexLock progress(&progress_mu_);
  // p's last completed step, or an earlier one, completed the shard's and
  // its observer has not returned. (One the shard has not completed yet
  // holds nothing: its observer cannot run before p's next step anyway.)
  if (released_step_ >= std::min(observed_step_, p.next_step - 1)) return false;
  p.completing = true;  // a retry arriving meanwhile only waits
  if (trace::Enabled()) p.held_since_us = trace::NowMicros();
  held_.push_back(&p);
  return true;
}

void ShardCore::StartCompletion(PartitionState& p, Completion* completion,
                                bool* schedule) {
  if (HoldForObservers(p)) return;
  if (pool_ == nullptr) {
    *completion = CompleteLocked(p);
  } else {
    p.completing = true;  // a retry arriving meanwhile only waits
    *schedule = true;
  }
}

void ShardCore::Push(PushArgs args, ReplyCallback done) {
  trace::Scope traced("push", args.step, args.partition);
  const auto reject = [&](absl::Status status) {
    {
      MutexLock progress(&progress_mu_);
      ++rejected_;
    }
    done(std::move(status));
  };
  if (absl::Status s = CheckPushArgs(args); !s.ok()) return reject(s);
  PartitionState& p = *partitions_[args.partition -
                                   layout_.shard_partitions(shard_).front().id];
  // On this push's thread while its bytes are in cache, outside the lock.
  const uint64_t hash = compress::BytesHash(args.payload);
  std::shared_ptr<const Reply> reply;  // a retry's
  Completion completion;               // the step this push completed, inline
  bool schedule = false;               // ... or on the pool
  bool committed = false;  // this push's commit completed the step before
  bool observe = false;    // ... and the shard's, whose observer is due
  {
    MutexLock lock(&p.mu);
    if (!p.initialized) {
      return reject(absl::UnavailableError(absl::StrCat(
          "partition ", args.partition,
          " has no initial parameters yet (rank 0 uploads them)")));
    }
    if (std::optional<absl::Status> stopped = AbortFor(args.step))
      return reject(*stopped);
    if (std::optional<absl::Status> stopping = Stopping())
      return reject(*stopping);
    if (args.step < p.next_step) {  // a completed step: the reply it had
      absl::StatusOr<std::shared_ptr<const Reply>> kept =
          KeptReply(p, args, hash);
      if (!kept.ok()) return reject(kept.status());
      reply = *std::move(kept);
      if (!p.live[args.rank] && !p.completing) {
        // A worker catching up (late, or rejoined and replaying): the step
        // in flight waits for it, up to step_seconds, so that it can join
        // again rather than trail a job that never waits (design.md 4,
        // "Membership").
        p.live[args.rank] = true;
        ++p.live_count;
      }
    } else {  // the step in flight
      StepCommit carried;
      bool commits = false;
      if (absl::Status s = CheckCurrentPush(p, args, &carried, &commits);
          !s.ok()) {
        return reject(s);
      }
      if (commits) {
        ApplyCommit(p, carried);
        committed = true;
        observe = CountCompleted(args.step - 1);
      }
      if (absl::Status s =
              AcceptPush(p, args, hash, done, &completion, &schedule);
          !s.ok()) {
        return reject(s);
      }
    }
  }
  {
    MutexLock progress(&progress_mu_);
    ++accepted_;
  }
  if (observe) RunObservers();
  if (committed) MirrorSoon(p);
  if (schedule) {
    pool_->Schedule([this, &p] { CompleteOnPool(p); });
  } else if (!completion.waiters.empty()) {
    Answer(p, std::move(completion));
  } else if (reply != nullptr) {
    done(reply);  // the retry of a completed step
  }
}

ShardCore::Completion ShardCore::CompleteLocked(PartitionState& p) {
  Completion c;
  absl::StatusOr<std::shared_ptr<const Reply>> result = Complete(p);
  c.waiters.swap(p.waiters);
  if (result.ok()) {
    c.reply = *std::move(result);
    c.observe = !p.awaiting_commit && CountCompleted(c.reply->step);
  } else {
    c.failure = result.status();
  }
  return c;
}

void ShardCore::CompleteOnPool(PartitionState& p) {
  Completion completion;
  {
    MutexLock lock(&p.mu);
    // ExpireWaiting skips a partition being completed, but an Abort may
    // have cleared it (ClearPending), and then this task has nothing to do.
    if (!p.completing) return;
    p.completing = false;
    MORSE_CHECK(p.arrived == p.live_count);  // only ClearPending lowers it
    if (p.held_since_us >= 0) {
      trace::Complete("held", p.held_since_us, p.next_step, p.partition.id);
      p.held_since_us = -1;
    }
    completion = CompleteLocked(p);
  }
  Answer(p, std::move(completion));
}

void ShardCore::Answer(PartitionState& p, Completion c) {
  // The observer first (it sees the step complete before any worker can
  // start the next; what it reads of the mirror is brought up to date),
  // then the replies, then the mirror update of this partition.
  // A step that waits for its commit (a clipped average's norm, or the
  // optimizer's values) completes when that arrives (Commit, or the next
  // step's pushes).
  const bool ok = c.failure.ok();
  if (c.observe) RunObservers();
  {
    trace::Scope traced("reply", ok ? c.reply->step : -1, p.partition.id);
    for (auto& [rank, callback] : c.waiters) {
      if (ok) {
        callback(c.reply);
      } else {
        callback(c.failure);
      }
    }
  }
  if (ok) MirrorSoon(p);
}

int64_t ShardCore::NextExchange(const PartitionState& p) const {
  return compress::NextExchange(job_.algorithm, p.next_step);
}

std::optional<absl::Status> ShardCore::AbortFor(int64_t step) const {
  MutexLock lock(&abort_mu_);
  if (!abort_.has_value() || step < abort_->first) return std::nullopt;
  return absl::FailedPreconditionError(abort_->second);
}

absl::Status ShardCore::Abort(uint32_t rank, int64_t step,
                              uint64_t layout_fingerprint,
                              absl::string_view reason) {
  // CheckCommon with this shard's first partition: the layout and the rank.
  if (absl::Status s = CheckCommon(rank, partitions_.front()->partition.id,
                                   layout_fingerprint);
      !s.ok()) {
    return s;
  }
  if (step < 0) return absl::InvalidArgumentError("negative step");
  constexpr size_t kMaxReason = 4096;
  {
    MutexLock lock(&abort_mu_);
    if (abort_.has_value()) return absl::OkStatus();  // the first abort wins
    abort_.emplace(
        step, absl::StrCat("rank ", rank, " stopped the job at step ", step,
                           ": ", reason.substr(0, kMaxReason)));
  }
  std::fprintf(stderr, "shard %u: rank %u stopped the job at step %lld: %.*s\n",
               shard_, rank, static_cast<long long>(step),
               static_cast<int>(std::min(reason.size(), kMaxReason)),
               reason.data());
  // Pushes that arrive from now on see abort_ under their partition's lock;
  // those already waiting are answered here. Their step never completes, so
  // its pending pushes are dropped (a restarted job pushes it again).
  const absl::Status stopped = *AbortFor(step);
  for (auto& part : partitions_) {
    PartitionState& p = *part;
    std::vector<std::pair<uint32_t, ReplyCallback>> waiters;
    {
      MutexLock lock(&p.mu);
      if (p.next_step < step) continue;
      waiters.swap(p.waiters);
      p.ClearPending();
    }
    for (auto& [unused, callback] : waiters) callback(stopped);
  }
  return absl::OkStatus();
}

void ShardCore::Stop(const absl::Status& why) {
  {
    MutexLock lock(&abort_mu_);
    stopping_ = why;
  }
  // Pushes that arrive from now on see stopping_ under their partition's
  // lock; those already waiting are answered here.
  for (auto& part : partitions_) {
    PartitionState& p = *part;
    std::vector<std::pair<uint32_t, ReplyCallback>> waiters;
    {
      MutexLock lock(&p.mu);
      if (p.completing) continue;  // answered as it completes
      waiters.swap(p.waiters);
      p.ClearPending();
    }
    for (auto& [unused, callback] : waiters) callback(why);
  }
}

std::optional<absl::Status> ShardCore::Stopping() const {
  MutexLock lock(&abort_mu_);
  return stopping_;
}

void ShardCore::ClearAbort() {
  MutexLock lock(&abort_mu_);
  abort_.reset();
}

std::vector<bool> ShardCore::InSomeMembership() const {
  std::vector<bool> in(job_.workers(), false);
  for (const auto& state : partitions_) {
    MutexLock lock(&state->mu);
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      if (state->live[r]) in[r] = true;
    }
  }
  return in;
}

void ShardCore::SetMembership(const std::vector<bool>& members) {
  MORSE_CHECK(members.size() == job_.workers());
  for (const auto& state : partitions_) {
    MutexLock lock(&state->mu);
    MORSE_CHECK(state->arrived == 0);  // before any push
    state->live_count = 0;
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      state->live[r] = members[r];
      state->live_count += members[r] ? 1 : 0;
    }
  }
}

std::optional<std::string> ShardCore::aborted() const {
  MutexLock lock(&abort_mu_);
  if (!abort_.has_value()) return std::nullopt;
  return abort_->second;
}

absl::StatusOr<std::shared_ptr<const Reply>> ShardCore::Complete(
    PartitionState& p) {
  ApplyMirror(p);                   // step t's mirror before step t + 1's reply
  MORSE_CHECK(!p.awaiting_commit);  // Push took step t's norm first
  const compress::Partition& part = p.partition;
  const std::optional<compress::StepHyper> hyper = p.hyper;
  const uint64_t n = part.range.size();
  const int64_t step = NextExchange(p);
  trace::Scope traced("sum and recompress", step, part.id);
  const compress::StepPlan plan = compress::PlanStep(job_.algorithm, step);
  // The members' pushes in rank order; the average is over them.
  std::vector<absl::Span<const uint8_t>> views;
  auto reply = std::make_shared<Reply>();
  for (uint32_t r = 0; r < p.pushes.size(); ++r) {
    const std::optional<std::string>& push = p.pushes[r];
    if (!push.has_value()) {
      reply->absent.push_back(r);
      continue;
    }
    views.emplace_back(reinterpret_cast<const uint8_t*>(push->data()),
                       push->size());
  }
  reply->step = step;
  reply->partition = part.id;
  reply->codec = plan.down.kind;
  reply->buffers = std::move(p.buffers);
  const compress::SendRule rule =
      compress::PlanSend(job_.algorithm, step, compress::Direction::kDown,
                         job_.workers() + shard_, part.range.begin);
  reply->payload.resize(compress::SendBytes(rule, n));
  auto payload = absl::MakeSpan(
      reinterpret_cast<uint8_t*>(reply->payload.data()), reply->payload.size());
  const uint64_t offset = part.range.begin - range_.begin;
  const absl::Span<const float> mask_v =
      rule.mask ? mirror_.VarianceMask(part.range.begin, n)
                : absl::Span<const float>();
  absl::Status status = compress::EncodeShardReply(
      rule, plan.up, views, server_error_, offset, n, mask_v, payload);
  const bool clips =
      compress::ClipsAverage(job_.algorithm, step) || p.workers_clip;
  if (status.ok() && clips) {
    // The norm every replica computes from the decoded reply, not from the
    // average (a lossy codec changes it).
    const absl::Span<float> average =
        compress::Scratch(compress::ScratchSlot::kShardAverage, n);
    status = compress::Decode(rule.codec, payload, average);
    if (status.ok() && p.workers_clip) {  // every order in one pass
      const compress::GradientNorms norms = compress::AllGradientNorms(average);
      reply->grad_sum_of_squares = norms.sum_of_squares;
      reply->grad_other_norms = norms.other;
    } else if (status.ok()) {
      reply->grad_sum_of_squares = compress::GradientSumOfSquares(average);
    }
  }
  std::vector<uint64_t> hashes = p.push_hashes;
  const bool workers_clip = p.workers_clip;
  p.ClearPending();
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("partition ", part.id, " step ", step,
                     ": recompression failed: ", status.message()));
  }
  // An optimizer with a layer rule (onebit_lamb): the mirror takes the
  // reply's moments now (x moves with the workers' commit) and sends the
  // layer statistics of the partition's pieces with the reply, the same
  // bits every worker would take from its own replica (design.md 2.8). A
  // step that clips the average scales its moments by a factor the commit
  // brings: the workers take those themselves.
  const compress::LayerRule* layers =
      compress::OptimizerOf(job_.algorithm).Layers();
  const bool piece_stats = layers != nullptr && !clips;
  if (piece_stats) {
    trace::Scope moments("mirror", step, part.id);
    std::vector<double> segments;
    ApplyOwnReply(*reply, part, hyper, 1.0f, &segments);
    reply->piece_stats = compress::PieceStats(
        *layers, compress::LayerPiecesOf(job_.algorithm, part.range), segments);
  }
  if (p.last_reply != nullptr && job_.replay_steps > 1) {
    p.history.push_back({std::move(p.last_reply), p.last_hashes});
    while (p.history.size() > job_.replay_steps - 1) p.history.pop_front();
  }
  p.last_hashes = std::move(hashes);
  p.last_reply = reply;
  p.restored = false;
  p.next_step = step + 1;
  // The mirror applies this reply after the workers have it (Push), or
  // before anything reads the mirror.
  p.mirror_pending = true;
  p.mirror_moments_applied = piece_stats;
  p.mirror_hyper = hyper;
  p.awaiting_commit = clips || layers != nullptr;
  p.committed_norm.reset();
  p.committed_max_norm.reset();
  p.last_workers_clip = workers_clip;
  p.last_step_restored = false;
  p.committed_values.clear();
  p.mirror_scale = 1.0f;
  p.committed_pieces.clear();
  p.committed_amendment.clear();
  p.committed_amendment_hash.reset();
  return std::shared_ptr<const Reply>(std::move(reply));
}

void ShardCore::ApplyOwnReply(
    const Reply& r, const compress::Partition& part,
    const std::optional<compress::StepHyper>& hyper, float scale,
    std::vector<double>* segment_stats,
    absl::Span<const compress::ClipPiece> clip_pieces) const {
  const absl::Status s = mirror_.ApplyReply(
      r.step, part.range.begin, part.range.size(),
      {reinterpret_cast<const uint8_t*>(r.payload.data()), r.payload.size()},
      hyper.has_value() ? &*hyper : nullptr, scale, segment_stats, clip_pieces);
  // The payload is this shard's own encoding of finite values: decoding it
  // cannot fail. If it ever did, the mirror would be wrong: stop loudly.
  MORSE_CHECK(s.ok());
}

void ShardCore::ApplyMirror(PartitionState& p) const {
  if (!p.mirror_pending || p.awaiting_commit) return;
  p.mirror_pending = false;
  const Reply& r = *p.last_reply;
  trace::Scope traced("mirror", r.step, p.partition.id);
  if (!p.committed_amendment.empty()) {
    // The workers' amended gradient in place of the reply (design.md 2.6,
    // "Edits after the clip"), checked when it arrived (CheckCommit).
    MORSE_CHECK(!p.mirror_moments_applied);  // a clipped step's mirror waits
    MORSE_CHECK(
        mirror_
            .ApplyReply(
                r.step, p.partition.range.begin, p.partition.range.size(),
                {reinterpret_cast<const uint8_t*>(p.committed_amendment.data()),
                 p.committed_amendment.size()},
                p.mirror_hyper.has_value() ? &*p.mirror_hyper : nullptr, 1.0f,
                nullptr, {}, /*amended=*/true)
            .ok());
    p.committed_amendment.clear();
    p.committed_amendment.shrink_to_fit();
  } else if (!p.mirror_moments_applied) {
    ApplyOwnReply(
        r, p.partition, p.mirror_hyper, p.mirror_scale, nullptr,
        compress::ClipPiecesOf(p.committed_pieces, p.partition.range.begin,
                               p.partition.range.end));
  }
  p.mirror_moments_applied = false;
  if (!p.committed_values.empty()) {  // checked when it arrived (CheckCommit)
    MORSE_CHECK(mirror_
                    .ApplyCommit(
                        r.step, p.partition.range.begin,
                        p.partition.range.size(), p.committed_values,
                        p.mirror_hyper.has_value() ? &*p.mirror_hyper : nullptr)
                    .ok());
    p.whole_state = compress::OptimizerOf(job_.algorithm)
                        .StateAfterCommit(job_.algorithm, p.committed_values);
  }
}

absl::Status ShardCore::CheckCommit(const PartitionState& p, uint32_t rank,
                                    int64_t step, const StepCommit& commit,
                                    bool* applies) const {
  *applies = false;
  const compress::Optimizer& optimizer = compress::OptimizerOf(job_.algorithm);
  const bool values = !commit.values.empty();
  const bool norm = commit.grad_sum_of_squares.has_value();
  const std::string what = values ? absl::StrCat(optimizer.name(), "'s commit")
                                  : "the gradient norm";
  if (!values && !norm) return absl::InvalidArgumentError("an empty commit");
  if (commit.clip_max_norm.has_value() && !norm) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank,
                     ": a commit with a clip's max_norm needs the gradient's "
                     "sum of squares"));
  }
  if (values) {
    const uint64_t expected = optimizer.CommitDoubles(job_.algorithm);
    if (expected == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " sent a commit of ", commit.values.size(),
          " values for a job whose optimizer (", optimizer.name(),
          ") commits none"));
    }
    if (commit.values.size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": a commit of ", commit.values.size(),
                       " values; ", optimizer.name(), " commits ", expected));
    }
    if (absl::Status s =
            optimizer.ValidateCommit(job_.algorithm, commit.values);
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": ", s.message()));
    }
  }
  if (norm) {
    const double total = *commit.grad_sum_of_squares;
    if (!std::isfinite(total) || total < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": the gradient's sum of squares ", total,
                       " must be finite and not negative"));
    }
    if (commit.clip_max_norm.has_value() &&
        !(std::isfinite(*commit.clip_max_norm) && *commit.clip_max_norm >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": the clip's max_norm ", *commit.clip_max_norm,
          " must be finite and not negative"));
    }
  }
  if (!commit.clip_pieces.empty()) {
    if (!norm || commit.clip_max_norm.value_or(1.0f) != 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank,
                       ": a clip of part of the model comes with the "
                       "gradient's sum of squares and a max_norm of 0"));
    }
    if (absl::Status s = compress::ValidateClipPieces(
            commit.clip_pieces, job_.algorithm.layout.dim);
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": ", s.message()));
    }
  }
  // This partition's part of an amended gradient, if the commit has one.
  const std::string* amendment = nullptr;
  if (!commit.amended.empty()) {
    if (!norm || commit.clip_max_norm.value_or(1.0f) != 0.0f ||
        !commit.clip_pieces.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank,
          ": an amended gradient comes with the gradient's sum of squares, a "
          "max_norm of 0 and no clip pieces"));
    }
    amendment = AmendmentOf(commit, p.partition.id);
    if (amendment == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": an amended gradient without partition ",
          p.partition.id, ", which this shard holds"));
    }
    const uint64_t n = p.partition.range.size();
    if (amendment->size() != 4 * n) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": an amended gradient of ",
                       amendment->size(), " bytes for partition ",
                       p.partition.id, " of ", n, " elements (4 bytes each)"));
    }
    for (uint64_t i = 0; i < n; ++i) {
      float value;
      std::memcpy(&value, amendment->data() + 4 * i, 4);
      if (!std::isfinite(value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", rank, ": the amended gradient's element ",
                         p.partition.range.begin + i, " is ", value));
      }
    }
  }
  if (step >= p.next_step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " sent ", what, " of step ", step, " but partition ",
        p.partition.id, " has completed ", p.next_step, " steps"));
  }
  if (step < p.next_step - 1 || p.last_step_restored) {
    return absl::OkStatus();  // applied long ago, or before a checkpoint
  }
  // What the step waits for: the optimizer's commit (every step of one that
  // commits) and, when it clipped the averaged gradient, its norm; both in
  // one commit when it needs both (design.md 2.6).
  const bool needs_norm =
      compress::ClipsAverage(job_.algorithm, step) || p.last_workers_clip;
  if (norm && !needs_norm) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " sent a gradient norm for step ", step,
        ", which does not clip the averaged gradient (clip_grad_norm ",
        job_.algorithm.clip_grad_norm, ", ",
        compress::PhaseName(job_.algorithm, step),
        " phase, and its pushes did not say workers_clip)"));
  }
  if (needs_norm && !norm) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, "'s commit of step ", step,
        " has no gradient norm: the step clipped the averaged gradient, and "
        "its commit carries the sum of squares with ",
        optimizer.name(), "'s values"));
  }
  if (!values && optimizer.CommitDoubles(job_.algorithm) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, "'s commit of step ", step, " has no ",
                     optimizer.name(), " values: its mirror moves x by them"));
  }
  if (norm && p.last_workers_clip != commit.clip_max_norm.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, "'s commit of step ", step,
        p.last_workers_clip ? " has no max_norm, which the step's pushes "
                              "said the workers would choose (workers_clip)"
                            : " has a max_norm, but the job's clip_grad_norm "
                              "clips that step"));
  }
  // The same commit again is OK; another one is refused.
  if (values && !p.committed_values.empty() &&
      (p.committed_values.size() != commit.values.size() ||
       std::memcmp(p.committed_values.data(), commit.values.data(),
                   8 * commit.values.size()) != 0)) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " sent another commit for step ", step,
                     " than was sent before (", optimizer.name(),
                     "); every worker computes the same one"));
  }
  if (norm && p.committed_norm.has_value()) {
    const double total = *commit.grad_sum_of_squares;
    if (std::memcmp(&*p.committed_norm, &total, sizeof(double)) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, " sent ", total,
                       " as the gradient's sum of squares at step ", step,
                       " but ", *p.committed_norm,
                       " was sent before; every worker adds the same replies"));
    }
    if (p.committed_max_norm.has_value() &&
        std::memcmp(&*p.committed_max_norm, &*commit.clip_max_norm,
                    sizeof(float)) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, " clipped step ", step, " by max_norm ",
                       *commit.clip_max_norm, " but ", *p.committed_max_norm,
                       " was sent before; every worker must clip alike"));
    }
    if (!compress::SameClipPieces(p.committed_pieces, commit.clip_pieces)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " clipped step ", step, " in ",
          commit.clip_pieces.size(), " piece(s), another clip than the ",
          p.committed_pieces.size(),
          " piece(s) sent before; every worker must clip alike, and edit "
          ".grad alike after clip_grad_norm_"));
    }
    const std::optional<uint64_t> hash =
        amendment != nullptr
            ? std::optional<uint64_t>(compress::BytesHash(*amendment))
            : std::nullopt;
    if (hash != p.committed_amendment_hash) {
      const char* how = amendment == nullptr
                            ? " does not amend the gradient of partition "
                            : " amends the gradient of partition ";
      const char* before = amendment == nullptr
                               ? ", which the one sent before amended"
                           : p.committed_amendment_hash.has_value()
                               ? " otherwise than the one sent before"
                               : ", which the one sent before did not amend";
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, "'s commit of step ", step, how,
                       p.partition.id, before,
                       "; every worker must edit .grad alike after "
                       "clip_grad_norm_"));
    }
  }
  if (!p.awaiting_commit) return absl::OkStatus();  // applied, or restored past
  const std::optional<double> own = p.last_reply != nullptr
                                        ? p.last_reply->grad_sum_of_squares
                                        : std::nullopt;
  if (norm && own.has_value() && *commit.grad_sum_of_squares < *own) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " sent ", *commit.grad_sum_of_squares,
        " as the gradient's sum of squares at step ", step,
        ", less than partition ", p.partition.id, "'s own ", *own));
  }
  *applies = true;
  return absl::OkStatus();
}

void ShardCore::ApplyCommit(PartitionState& p, const StepCommit& commit) const {
  if (commit.grad_sum_of_squares.has_value()) {
    p.committed_norm = *commit.grad_sum_of_squares;
    p.committed_max_norm = commit.clip_max_norm;
    p.mirror_scale = compress::ClipScale(
        *commit.grad_sum_of_squares,
        commit.clip_max_norm.value_or(job_.algorithm.clip_grad_norm));
    p.committed_pieces = commit.clip_pieces;
  }
  p.committed_values = commit.values;
  if (const std::string* values = AmendmentOf(commit, p.partition.id)) {
    p.committed_amendment = *values;
    p.committed_amendment_hash = compress::BytesHash(*values);
  }
  p.awaiting_commit = false;
}

void ShardCore::MirrorSoon(PartitionState& p) {
  const auto apply = [this, &p] {
    MutexLock lock(&p.mu);
    ApplyMirror(p);
  };
  if (pool_ == nullptr) {
    apply();
  } else {
    // Behind the sums and replies workers wait for; whatever reads the
    // mirror first (the partition's next step, a checkpoint, a fetch, the
    // observer) applies it itself, and then this finds nothing to do.
    pool_->ScheduleBackground(apply);
  }
}

absl::Status ShardCore::Commit(uint32_t rank, int64_t step,
                               uint64_t layout_fingerprint, double total,
                               std::optional<float> clip_max_norm) {
  return CommitStep(rank, step, layout_fingerprint,
                    StepCommit{total, clip_max_norm, {}, {}});
}

absl::Status ShardCore::CommitValues(uint32_t rank, int64_t step,
                                     uint64_t layout_fingerprint,
                                     std::vector<double> commit) {
  if (commit.empty()) return absl::InvalidArgumentError("an empty commit");
  return CommitStep(
      rank, step, layout_fingerprint,
      StepCommit{std::nullopt, std::nullopt, std::move(commit), {}});
}

absl::Status ShardCore::CommitStep(uint32_t rank, int64_t step,
                                   uint64_t layout_fingerprint,
                                   const StepCommit& commit) {
  if (absl::Status s = CheckCommon(rank, partitions_.front()->partition.id,
                                   layout_fingerprint);
      !s.ok()) {
    return s;
  }
  if (step < 0) return absl::InvalidArgumentError("negative step");
  // A commit with an amended gradient is of the partitions it names (one
  // request each: Commit sends them apart), which must be this shard's.
  for (const auto& [partition, values] : commit.amended) {
    if (partition >= layout_.partitions().size() ||
        layout_.partitions()[partition].shard != shard_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": an amended gradient of partition ",
                       partition, ", which shard ", shard_, " does not hold"));
    }
  }
  // Every partition checked before any changes (locks in order, as Snapshot).
  std::vector<std::unique_ptr<MutexLock>> locks;
  std::vector<bool> applies(partitions_.size());
  for (size_t i = 0; i < partitions_.size(); ++i) {
    PartitionState& p = *partitions_[i];
    if (!commit.amended.empty() &&
        AmendmentOf(commit, p.partition.id) == nullptr)
      continue;
    locks.push_back(std::make_unique<MutexLock>(&p.mu));
    bool a = false;
    if (absl::Status s = CheckCommit(p, rank, step, commit, &a); !s.ok()) {
      // A shard restarted from a checkpoint before `step`: the workers'
      // replayed pushes of the next step carry the commit, and the caller
      // learns how far the partition is.
      if (step >= p.next_step)
        s.SetPayload(kNextStepPayload, absl::Cord(absl::StrCat(p.next_step)));
      return s;
    }
    applies[i] = a;
  }
  bool observe = false;
  for (size_t i = 0; i < partitions_.size(); ++i) {
    if (!applies[i]) continue;
    ApplyCommit(*partitions_[i], commit);
    observe = CountCompleted(step) || observe;
  }
  locks.clear();
  if (observe) RunObservers();
  for (size_t i = 0; i < partitions_.size(); ++i) {
    if (applies[i]) MirrorSoon(*partitions_[i]);
  }
  return absl::OkStatus();
}

void ShardCore::FlushMirrors() const {
  for (const auto& p : partitions_) {
    MutexLock lock(&p->mu);
    ApplyMirror(*p);
  }
}

bool ShardCore::CountCompleted(int64_t step) {
  MutexLock progress(&progress_mu_);
  if (++completions_[step] < partitions_.size()) return false;
  // Steps finish in order: a step's replies are all out before any
  // worker can push the next one.
  // (zero_one_adam's local steps complete nothing: the next exchange.)
  bool due = false;
  while (!completions_.empty() &&
         completions_.begin()->first ==
             compress::NextExchange(job_.algorithm, observed_step_ + 1) &&
         completions_.begin()->second == partitions_.size()) {
    observed_step_ = completions_.begin()->first;
    unobserved_.push_back(observed_step_);
    completions_.erase(completions_.begin());
    due = true;
  }
  return due;
}

void ShardCore::RunObservers() {
  std::vector<PartitionState*> held;
  {
    // Whichever thread takes the lock first runs every observer due, in
    // order; the others find none left.
    MutexLock observing(&observer_mu_);
    while (true) {
      int64_t step;
      {
        MutexLock progress(&progress_mu_);
        if (unobserved_.empty()) {
          held.swap(held_);  // released_step_ == observed_step_ now
          break;
        }
        step = unobserved_.front();
        unobserved_.pop_front();
      }
      if (observer_) observer_(step, *this);
      MutexLock progress(&progress_mu_);
      released_step_ = step;
    }
  }
  for (PartitionState* p : held) {
    if (pool_ != nullptr) {
      pool_->Schedule([this, p] { CompleteOnPool(*p); });
    } else {
      CompleteOnPool(*p);
    }
  }
}

std::vector<uint32_t> ShardCore::Missing(const PartitionState& p) const {
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < p.pushes.size(); ++r) {
    if (p.live[r] && !p.pushes[r].has_value()) missing.push_back(r);
  }
  return missing;
}

std::optional<std::string> ShardCore::Stalled(absl::Time now) const {
  const absl::Duration patience = absl::Seconds(job_.step_timeout_seconds);
  std::optional<std::string> oldest;
  absl::Duration longest;
  for (const auto& state : partitions_) {
    PartitionState& p = *state;
    MutexLock lock(&p.mu);
    // One with every push in is completing (or held for an observer).
    if (p.arrived == 0 || p.completing || now - p.first_arrival < patience)
      continue;
    // An elastic job's step with min_workers pushes is not stalled: it
    // completes without the others (ExpireWaiting).
    if (job_.elastic() && p.arrived >= job_.min_workers) continue;
    if (oldest.has_value() && now - p.first_arrival <= longest) continue;
    longest = now - p.first_arrival;
    oldest = absl::StrCat(
        "step ", NextExchange(p), " of partition ", p.partition.id,
        " has waited ",
        absl::FormatDuration(absl::Trunc(longest, absl::Seconds(1))),
        " for rank(s) ", absl::StrJoin(Missing(p), ", "),
        job_.elastic()
            ? absl::StrCat("; ", p.arrived, " pushed, fewer than min_workers (",
                           job_.min_workers, ")")
            : "",
        "; it fails after ", job_.recovery_timeout_seconds,
        " s (timeouts.recovery_seconds)");
  }
  return oldest;
}

absl::Time ShardCore::NextDeadline() const {
  absl::Time next = absl::InfiniteFuture();
  if (job_.straggler_timeout_seconds <= 0) return next;
  const absl::Duration grace = absl::Seconds(job_.straggler_timeout_seconds);
  for (const auto& state : partitions_) {
    PartitionState& p = *state;
    MutexLock lock(&p.mu);
    if (p.arrived >= job_.min_workers && !p.completing)
      next = std::min(next, p.quorum_arrival + grace);
  }
  return next;
}

std::vector<std::string> ShardCore::ExpireWaiting(absl::Time now) {
  const absl::Duration timeout = absl::Seconds(job_.recovery_timeout_seconds);
  const absl::Duration patience = absl::Seconds(job_.step_timeout_seconds);
  const absl::Duration grace = absl::Seconds(job_.straggler_timeout_seconds);
  // (step, ranks left out) -> the partitions: one line for each.
  std::map<std::pair<int64_t, std::vector<uint32_t>>, std::vector<uint32_t>>
      dropped;
  for (auto& state : partitions_) {
    PartitionState& p = *state;
    std::vector<std::pair<uint32_t, ReplyCallback>> waiters;
    absl::Status status;
    std::optional<Completion> completion;
    {
      MutexLock lock(&p.mu);
      // A partition with every push in is being completed, not waiting.
      if (p.arrived == 0 || p.completing) continue;
      const absl::Duration waited = now - p.first_arrival;
      const std::vector<uint32_t> missing = Missing(p);
      // Stragglers: straggler_seconds since the min_workers-th push.
      const bool straggling = job_.straggler_timeout_seconds > 0 &&
                              p.arrived >= job_.min_workers &&
                              now - p.quorum_arrival >= grace;
      if (job_.elastic() && p.arrived >= job_.min_workers &&
          (waited >= patience || straggling)) {
        // The step completes with the pushes it has; the missing ranks
        // leave the partition's membership until they push again.
        for (uint32_t r : missing) p.live[r] = false;
        p.live_count -= static_cast<uint32_t>(missing.size());
        {
          MutexLock progress(&progress_mu_);
          dropped_ += missing.size();
          if (waited < patience) ++straggler_steps_;
        }
        if (waited >= patience)
          dropped[{NextExchange(p), missing}].push_back(p.partition.id);
        if (!HoldForObservers(p)) completion = CompleteLocked(p);
      } else if (waited >= timeout) {
        status = absl::DeadlineExceededError(absl::StrCat(
            "step ", NextExchange(p), " of partition ", p.partition.id,
            " timed out after ", job_.recovery_timeout_seconds,
            " s (timeouts.recovery_seconds): rank(s) ",
            absl::StrJoin(missing, ", "), " did not push",
            job_.elastic()
                ? absl::StrCat(", and the ", p.arrived,
                               " that did are fewer than min_workers (",
                               job_.min_workers, ")")
                : "",
            "; is a worker down?"));
        // The shard gave up on the step: the workers must not retry it.
        status.SetPayload(proto::kStepExpiredKey, absl::Cord("1"));
        p.ClearPending();
        waiters.swap(p.waiters);
      }
    }
    if (completion.has_value()) Answer(p, *std::move(completion));
    for (auto& [rank, callback] : waiters) callback(status);
  }
  std::vector<std::string> changes;
  for (const auto& [what, parts] : dropped) {
    const auto& [step, missing] = what;
    changes.push_back(absl::StrCat(
        "step ", step, " completed without rank(s) ",
        absl::StrJoin(missing, ", "), " in ",
        parts.size() == 1
            ? absl::StrCat("partition ", parts[0])
            : absl::StrCat(parts.size(), " partitions (", parts.front(), "..",
                           parts.back(), ")"),
        " after ", job_.step_timeout_seconds,
        " s (timeouts.step_seconds; min_workers ", job_.min_workers,
        "): the missing leave the membership until they push again"));
  }
  return changes;
}

std::vector<compress::NamedState> ShardCore::StateOf(const PartitionState& p,
                                                     uint64_t begin,
                                                     uint64_t n) const {
  std::vector<compress::NamedState> state = mirror_.SaveState(begin, n);
  const std::vector<compress::StateArray> arrays =
      compress::OptimizerOf(job_.algorithm).State(job_.algorithm);
  size_t whole = 0;
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (!arrays[i].per_element) state[i].values = p.whole_state[whole++];
  }
  return state;
}

absl::StatusOr<PartitionSnapshot> ShardCore::FetchPartition(
    uint32_t partition, uint64_t fingerprint, FetchWhat what) const {
  if (absl::Status s = CheckCommon(0, partition, fingerprint); !s.ok())
    return s;
  PartitionState& p =
      *partitions_[partition - layout_.shard_partitions(shard_).front().id];
  MutexLock lock(&p.mu);
  if (!p.initialized) {
    return absl::UnavailableError(
        absl::StrCat("partition ", partition, " has no parameters yet"));
  }
  ApplyMirror(p);
  if (p.awaiting_commit) {
    return absl::UnavailableError(
        absl::StrCat("step ", p.next_step - 1, " of partition ", partition,
                     " waits for the workers' commit (clip_grad_norm's "
                     "gradient norm or the optimizer's commit); try again"));
  }
  const uint64_t offset = p.partition.range.begin - range_.begin,
                 n = p.partition.range.size();
  PartitionSnapshot snapshot;
  snapshot.completed_steps = p.next_step;
  if (what.model) {
    snapshot.x.assign(mirror_.x().begin() + offset,
                      mirror_.x().begin() + offset + n);
    snapshot.m.assign(mirror_.m().begin() + offset,
                      mirror_.m().begin() + offset + n);
    snapshot.v.assign(mirror_.v().begin() + offset,
                      mirror_.v().begin() + offset + n);
    snapshot.state = StateOf(p, p.partition.range.begin, n);
  }
  if (what.x_hash) {
    snapshot.x_hash = compress::XHash(mirror_.x().subspan(offset, n));
  }
  if (what.server_error) {
    // The error buffer changes only when a step completes, so it is the one
    // of completed_steps even while pushes of the next step wait.
    snapshot.server_error.resize(n);
    server_error_.Read(offset, absl::MakeSpan(snapshot.server_error));
  }
  return snapshot;
}

absl::Status ShardCore::RestorePartition(uint32_t rank, uint32_t partition,
                                         uint64_t fingerprint,
                                         const PartitionSnapshot& state) {
  if (absl::Status s = CheckCommon(rank, partition, fingerprint); !s.ok())
    return s;
  if (rank != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("only rank 0 restores a saved run, not rank ", rank));
  }
  PartitionState& p =
      *partitions_[partition - layout_.shard_partitions(shard_).front().id];
  const uint64_t offset = p.partition.range.begin - range_.begin,
                 n = p.partition.range.size();
  if (state.completed_steps < 0)
    return absl::InvalidArgumentError("negative step");
  // The optimizer's own arrays (onebit_lamb's v' and layer state, design.md
  // 2.8), as FetchPartition gives them.
  if (absl::Status s = compress::CheckState(
          job_.algorithm, n, state.state,
          absl::StrCat("the saved state of partition ", partition));
      !s.ok()) {
    return s;
  }
  for (const auto* a : {&state.x, &state.m, &state.v, &state.server_error}) {
    if (a->size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("partition ", partition, " has ", n,
                       " elements; the saved state has arrays of ",
                       state.x.size(), ", ", state.m.size(), ", ",
                       state.v.size(), " and ", state.server_error.size()));
    }
    for (float f : *a) {
      if (!std::isfinite(f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the saved state of partition ", partition, " holds Inf or NaN"));
      }
    }
  }
  for (float f : state.v) {
    if (f < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("the saved v of partition ", partition, " is negative"));
    }
  }
  bool all = false;
  {
    MutexLock lock(&p.mu);
    if (!p.initialized) {
      return absl::UnavailableError(
          absl::StrCat("partition ", partition, " has no parameters yet"));
    }
    if (p.arrived > 0 || (p.next_step > 0 && !p.restored)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", partition, " has trained (", p.next_step, " steps",
          p.arrived > 0 ? ", a push of the next one waiting" : "",
          "); a saved run is restored before the job's first step"));
    }
    if (absl::Status s = server_error_.RestoreRange(offset, state.server_error);
        !s.ok())
      return s;
    std::copy(state.x.begin(), state.x.end(), mirror_.x().begin() + offset);
    std::copy(state.m.begin(), state.m.end(),
              mirror_.mutable_m().begin() + offset);
    std::copy(state.v.begin(), state.v.end(),
              mirror_.mutable_v().begin() + offset);
    MORSE_CHECK(
        mirror_.RestoreState(p.partition.range.begin, n, state.state).ok());
    p.whole_state = WholeArrays(job_, state.state);
    p.next_step = state.completed_steps;
    p.restored = true;
    p.x_replaced_step = -1;
    p.x_replaced_after = -2;
    p.mirror_pending = false;
    p.mirror_moments_applied = false;
    p.awaiting_commit = false;
    p.committed_norm.reset();
    p.committed_max_norm.reset();
    p.last_workers_clip = false;
    p.last_step_restored = true;
    p.committed_values.clear();
    p.committed_amendment.clear();
    p.committed_amendment_hash.reset();
    p.last_reply = nullptr;
    std::fill(p.last_hashes.begin(), p.last_hashes.end(), 0);
    p.history.clear();
    {
      MutexLock progress(&progress_mu_);
      observed_step_ = state.completed_steps - 1;
      released_step_ = observed_step_;
      unobserved_.clear();
      completions_.clear();
      if (restored_step_ != state.completed_steps) {
        restored_step_ = state.completed_steps;
        restored_.clear();
      }
      restored_.insert(partition);
      all = restored_.size() == partitions_.size();
    }
  }
  if (all && change_observer_)
    change_observer_(
        state.completed_steps, *this,
        absl::StrCat("a saved run restored at step ", state.completed_steps));
  return absl::OkStatus();
}

absl::Status ShardCore::ReplaceX(uint32_t rank, uint32_t partition,
                                 uint64_t layout_fingerprint, int64_t step,
                                 absl::Span<const float> x) {
  if (absl::Status s = CheckCommon(rank, partition, layout_fingerprint);
      !s.ok())
    return s;
  if (rank != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "only rank 0 gives the shards changed weights, not rank ", rank));
  }
  PartitionState& p =
      *partitions_[partition - layout_.shard_partitions(shard_).front().id];
  const uint64_t offset = p.partition.range.begin - range_.begin,
                 n = p.partition.range.size();
  if (x.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition ", partition, " has ", n, " elements, not ", x.size()));
  }
  for (float f : x) {
    if (!std::isfinite(f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the new weights of partition ", partition, " hold Inf or NaN"));
    }
  }
  bool all = false;
  {
    MutexLock lock(&p.mu);
    if (!p.initialized) {
      return absl::UnavailableError(
          absl::StrCat("partition ", partition, " has no parameters yet"));
    }
    if (p.awaiting_commit) {
      return absl::UnavailableError(absl::StrCat("partition ", partition,
                                                 " waits for step ",
                                                 p.next_step - 1, "'s commit"));
    }
    ApplyMirror(p);
    float* mirror = mirror_.x().data() + offset;
    const bool same = std::memcmp(mirror, x.data(), n * sizeof(float)) == 0;
    if (p.x_replaced_after == step - 1 && same) {
      return absl::OkStatus();  // again (rank 0 restarted and replaying)
    }
    if (step > p.next_step && NextExchange(p) == p.next_step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", partition, " has completed ", p.next_step,
          " steps, not ", step,
          ": its shard restarted from an older checkpoint after step ",
          step - 1,
          ", and the steps between cannot be replayed before the weights "
          "change; restart the job from its checkpoints"));
    }
    // Right after a step that exchanged: before the next one, or before a
    // zero_one_adam interval, whose anchor x becomes.
    if (step != p.next_step || !compress::TakesChangedX(job_.algorithm, step)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", partition, " has completed ", p.next_step,
          " steps and pushes step ", NextExchange(p),
          " next; weights change right after a step that exchanged (rank 0 "
          "asked before step ",
          step, ")"));
    }
    // A partition the change left as it was may have pushes of the step
    // already: another rank found every partition holding its weights
    // once rank 0 had given the ones that changed (their hashes checked
    // those pushes against these bits).
    if (p.arrived > 0 && !same) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", p.hyper_rank, " pushed step ", step, " of partition ",
          partition,
          " from the weights before the change: change the weights the same "
          "way on every rank, before its step()"));
    }
    std::copy(x.begin(), x.end(), mirror);
    p.x_replaced_step = NextExchange(p);
    p.x_replaced_after = step - 1;
    p.x_replaced_hash = compress::XHash(x);
    MutexLock progress(&progress_mu_);
    if (replaced_step_ != step) {
      replaced_step_ = step;
      replaced_.clear();
    }
    replaced_.insert(partition);
    all = replaced_.size() == partitions_.size();
  }
  if (all && change_observer_)
    change_observer_(step, *this,
                     absl::StrCat("weights changed before step ", step));
  return absl::OkStatus();
}

uint64_t ShardCore::MirrorChecksum() const {
  FlushMirrors();
  return mirror_.Checksum();
}

double ShardCore::ServerErrorNorm() const {
  return std::sqrt(server_error_.SquaredNorm());
}

ShardStatus ShardCore::Status() const {
  ShardStatus s;
  s.shard = shard_;
  s.range = range_;
  s.layout_fingerprint = layout_.fingerprint();
  s.workers = job_.workers();
  s.partitions = static_cast<uint32_t>(partitions_.size());
  int64_t completed = INT64_MAX, kept_from = 0;
  std::vector<bool> out(job_.workers(), false);  // of some membership
  for (const auto& state : partitions_) {
    MutexLock lock(&state->mu);
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      if (!state->live[r]) out[r] = true;
    }
    completed = std::min(completed, state->next_step);
    kept_from = std::max(
        kept_from, !state->history.empty() ? state->history.front().reply->step
                   : state->last_reply != nullptr ? state->last_reply->step
                                                  : state->next_step);
  }
  s.completed_steps = completed;
  s.replies_kept_from = kept_from;
  for (uint32_t r = 0; r < job_.workers(); ++r) {
    if (out[r]) s.out.push_back(r);
  }
  MutexLock progress(&progress_mu_);
  s.workers_dropped = dropped_;
  s.straggler_steps = straggler_steps_;
  s.partitions_initialized = initialized_;
  s.pushes_accepted = accepted_;
  s.pushes_rejected = rejected_;
  return s;
}

}  // namespace morse::server
