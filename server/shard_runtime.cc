#include "server/shard_runtime.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace morse::server {

ShardRuntime::ShardRuntime(Options options) : options_(std::move(options)) {
  if (!options_.checkpoint_path.empty()) {
    checkpoints_ = std::make_unique<
        CheckpointThread>(options_.checkpoint_path, [this](const absl::Status&
                                                               saved,
                                                           int64_t step,
                                                           const std::string&
                                                               why) {
      if (saved.ok()) {
        {
          MutexLock lock(&mu_);
          durable_steps_ = std::max(durable_steps_, step);
        }
        Log(absl::StrFormat(
            "morse-server shard %u: checkpoint of step %d written to %s (%s)",
            options_.shard, step, options_.checkpoint_path, why));
      } else {
        Log(absl::StrFormat(
            "morse-server shard %u: no checkpoint written (%s): %s",
            options_.shard, why, saved.message()));
      }
    });
  }
}

void ShardRuntime::Log(const std::string& line) const {
  if (options_.log) return options_.log(line);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void ShardRuntime::SetMetrics(ServerMetrics* metrics) {
  MutexLock lock(&mu_);
  metrics_ = metrics;
}

void ShardRuntime::SaveCheckpoint(const ShardCore& core, const char* why) {
  auto snapshot = core.Snapshot();
  if (!snapshot.ok()) {
    Log(absl::StrFormat("morse-server shard %u: no checkpoint written (%s): %s",
                        options_.shard, why, snapshot.status().message()));
    return;
  }
  checkpoints_->Submit(*std::move(snapshot), why);
}

absl::Status ShardRuntime::OnConfigured(const proto::JobSpec& job,
                                        ShardCore& core, bool relaid) {
  if (relaid) {
    Log(absl::StrFormat(
        "morse-server shard %u: the model laid out anew (generation %u, %d "
        "parameters)",
        options_.shard, job.external.generation, job.algorithm.layout.dim));
  } else if (!options_.checkpoint_path.empty()) {
    absl::Status restored = core.RestoreCheckpoint(options_.checkpoint_path);
    if (restored.ok()) {
      Log(absl::StrFormat("morse-server shard %u: resumed from %s at step %d",
                          options_.shard, options_.checkpoint_path,
                          core.Status().completed_steps));
    } else if (restored.code() != absl::StatusCode::kNotFound) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot resume: ", restored.message(),
                       " (move the file away to start from scratch)"));
    }
  }
  {
    MutexLock lock(&mu_);
    durable_steps_ = core.Status().completed_steps;
  }
  const uint32_t every = job.checkpoint_every_steps, log_every = job.log_every;
  // How far the shard may get past its newest checkpoint on disk: the
  // workers hold the pushes of the last replay_steps steps.
  const int64_t slack =
      job.replay_steps > 0 ? static_cast<int64_t>(job.replay_steps) - 1 : every;
  core.SetStepObserver(
      [this, every, log_every, slack](int64_t step, const ShardCore& c) {
        StepCompleted(step, c, every, log_every, slack);
      });
  // Weights changed after a step (ShardCore::ReplaceX) are on disk before
  // rank 0 learns they are in: a restart from an older checkpoint would
  // replay the steps between without the change (design.md 4). So is a
  // saved run rank 0 restored (a resume, or add_param_group's new layout,
  // of which the shard has no other checkpoint).
  core.SetChangeObserver(
      [this](int64_t step, const ShardCore& c, absl::string_view what) {
        if (checkpoints_ == nullptr) return;
        SaveCheckpoint(c, std::string(what).c_str());
        checkpoints_->Flush();
      });
  core.SetWakeup([this](absl::Time deadline) {
    MutexLock lock(&wake_mu_);
    wake_at_ = std::min(wake_at_, deadline);
  });
  return absl::OkStatus();
}

void ShardRuntime::StepCompleted(int64_t step, const ShardCore& core,
                                 uint32_t every, uint32_t log_every,
                                 int64_t slack) {
  if (options_.state_log != nullptr) {
    *options_.state_log
        << absl::StrFormat(
               "{\"step\":%d,\"shard\":%u,\"mirror_checksum\":\"%016x\"}\n",
               step, options_.shard, core.MirrorChecksum())
        << std::flush;
  }
  if (checkpoints_ != nullptr && every > 0 && (step + 1) % every == 0) {
    SaveCheckpoint(core, "periodic");
  }
  // The workers keep the pushes of the last replay_steps (every + 1) steps
  // (DESIGN 4), and a shard restarted from its newest checkpoint must find
  // them all. The observer runs before this step's last replies go out,
  // and no partition completes step + 1 before it returns: if the newest
  // checkpoint on disk is more than `slack` steps behind step + 1, wait for
  // the write in flight. A write slower than a step (fsync under load) then
  // holds the next step back instead of making the run unrecoverable.
  if (checkpoints_ != nullptr && every > 0) {
    bool behind;
    {
      MutexLock lock(&mu_);
      behind = durable_steps_ < step + 1 - slack;
    }
    if (behind) checkpoints_->Flush();
  }
  const bool report = log_every > 0 && (step + 1) % log_every == 0;
  {
    MutexLock lock(&mu_);
    if (metrics_ != nullptr) {
      const absl::Time now = absl::Now();
      metrics_->StepCompleted(absl::ToDoubleSeconds(now - last_step_time_));
      last_step_time_ = now;
      if (report) metrics_->SetErrorNorm(core.ServerErrorNorm());
    }
  }
  if (report)
    Log(absl::StrFormat("morse-server shard %u: step %d completed",
                        options_.shard, step));
}

void ShardRuntime::Tick(ShardCore& core, absl::Time now) {
  if (now - last_stall_notice_ > absl::Seconds(5)) {
    if (std::optional<std::string> stalled = core.Stalled(now)) {
      Log(absl::StrFormat("morse-server shard %u: %s", options_.shard,
                          *stalled));
      last_stall_notice_ = now;
    }
  }
  const std::vector<std::string> changes = core.ExpireWaiting(now);
  for (const std::string& change : changes)
    Log(absl::StrFormat("morse-server shard %u: %s", options_.shard, change));
  const proto::JobSpec& job = core.job();
  if (job.straggler_timeout_seconds > 0 &&
      now - last_straggler_note_ >= absl::Seconds(10)) {
    // A slow worker is left out of many steps: one line now and then.
    const ShardStatus s = core.Status();
    if (s.straggler_steps > straggler_steps_noted_) {
      Log(absl::StrFormat(
          "morse-server shard %u: %d partition steps completed without their "
          "stragglers in the last %s (timeouts.straggler_seconds %g after "
          "min_workers %u pushes); out of the membership now: %s",
          options_.shard, s.straggler_steps - straggler_steps_noted_,
          absl::FormatDuration(
              absl::Trunc(now - last_straggler_note_, absl::Seconds(1))),
          job.straggler_timeout_seconds, job.min_workers,
          s.out.empty()
              ? "none"
              : absl::StrCat("rank(s) ", absl::StrJoin(s.out, ", "))));
    }
    straggler_steps_noted_ = s.straggler_steps;
    last_straggler_note_ = now;
  }
  // The membership gauge, read before taking mu_ again: the partitions'
  // locks are never taken inside it.
  {
    MutexLock lock(&mu_);
    if (metrics_ == nullptr) return;
  }
  const ShardStatus s = core.Status();
  MutexLock lock(&mu_);
  if (metrics_ != nullptr) {
    metrics_->SetMembership(s.workers - static_cast<uint32_t>(s.out.size()),
                            s.workers_dropped);
  }
}

void ShardRuntime::AwaitTick(const ShardCore* core, absl::Duration longest) {
  absl::Time due = absl::Now() + longest;
  if (core != nullptr) due = std::min(due, core->NextDeadline());
  MutexLock lock(&wake_mu_);
  struct Wait {
    const absl::Time& wake_at;
    absl::Time due;
  } wait{wake_at_, due};
  wake_mu_.AwaitWithDeadline(absl::Condition(
                                 +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                   return w->wake_at < w->due;
                                 },
                                 &wait),
                             due);
  wake_at_ = absl::InfiniteFuture();
}

void ShardRuntime::Shutdown(const ShardCore* core) {
  if (core == nullptr) {
    Log(absl::StrFormat(
        "morse-server shard %u: stopped before any worker joined",
        options_.shard));
    return;
  }
  if (checkpoints_ != nullptr) {
    SaveCheckpoint(*core, "shutdown");
    checkpoints_->Flush();
  }
  const ShardStatus s = core->Status();
  Log(absl::StrFormat(
      "morse-server shard %u: stopped after %d steps; %u pushes accepted, %u "
      "rejected",
      options_.shard, s.completed_steps, s.pushes_accepted, s.pushes_rejected));
}

void ShardRuntime::FlushCheckpoints() {
  if (checkpoints_ != nullptr) checkpoints_->Flush();
}

}  // namespace morse::server
