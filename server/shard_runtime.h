// ShardRuntime: what a morse-server process does around its ShardCore
// besides serving RPCs: resuming from its checkpoint, writing checkpoints
// (every checkpoint.every_steps steps, on a thread of its own, and at
// shutdown), the state log, progress and stall lines, the metrics of
// completed steps, and failing steps past the recovery timeout. main()
// parses flags and wires it to the gRPC server; tests drive it directly.
//
// OnConfigured is ShardHost's callback; Tick runs on the process's expiry
// thread; the step observer it installs runs on the thread that completed
// the step. Thread-safe in that arrangement.
#ifndef MORSE_SERVER_SHARD_RUNTIME_H_
#define MORSE_SERVER_SHARD_RUNTIME_H_

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "server/checkpoint_thread.h"
#include "server/metrics.h"
#include "server/shard_core.h"

namespace morse::server {

class ShardRuntime {
 public:
  struct Options {
    uint32_t shard = 0;
    std::string checkpoint_path;  // shard-<s>.ckpt; empty: no checkpoints
    std::ostream* state_log =
        nullptr;  // one JSON line per completed step; null: none
    // Where progress lines go (one line, no newline); default: stdout.
    std::function<void(const std::string&)> log;
  };

  explicit ShardRuntime(Options options);
  ShardRuntime(const ShardRuntime&) = delete;
  ShardRuntime& operator=(const ShardRuntime&) = delete;

  // Metrics of completed steps from now on (null: none).
  void SetMetrics(ServerMetrics* metrics);

  // ShardHost's OnConfigured: resumes `core` from the checkpoint if there is
  // one (FAILED_PRECONDITION, saying what to do, if it cannot be used),
  // unless `relaid` (a new layout mid-job: the file holds the old one's
  // state until the new core's first checkpoint), and installs the step
  // observer (state log, periodic checkpoints, metrics, a progress line
  // every log_every steps).
  absl::Status OnConfigured(const proto::JobSpec& job, ShardCore& core,
                            bool relaid = false);

  // One pass of the expiry loop at `now`: a line naming the ranks a stalled
  // step waits for (at most every 5 s), then ShardCore::ExpireWaiting, and
  // with stragglers a line counting the steps completed without them (at
  // most every 10 s).
  void Tick(ShardCore& core, absl::Time now);
  // The expiry loop's wait before the next Tick: at most `longest`, less
  // until `core`'s next straggler deadline (ShardCore::NextDeadline, or one
  // that a push sets meanwhile). `core` may be null.
  void AwaitTick(const ShardCore* core, absl::Duration longest);

  // At shutdown: a checkpoint of the shard if it is between steps (written
  // before this returns) and the summary line. `core` may be null (no
  // worker ever joined).
  void Shutdown(const ShardCore* core);

  // Waits until every submitted checkpoint is written.
  void FlushCheckpoints();

 private:
  void Log(const std::string& line) const;
  void SaveCheckpoint(const ShardCore& core, const char* why);
  void StepCompleted(int64_t step, const ShardCore& core, uint32_t every,
                     uint32_t log_every, int64_t slack);

  const Options options_;
  Mutex mu_;
  ServerMetrics* metrics_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Time last_step_time_ ABSL_GUARDED_BY(mu_) = absl::Now();
  // Completed steps of the newest checkpoint on disk (or of the state the
  // shard started from): a restarted shard resumes there, so the workers
  // must still hold every push since (checkpoint.replay_steps).
  int64_t durable_steps_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_stall_notice_ = absl::InfinitePast();  // the expiry thread's
  // Stragglers (timeouts.straggler_seconds): the expiry thread's last line
  // about them, and the count it gave.
  absl::Time last_straggler_note_ = absl::Now();
  uint64_t straggler_steps_noted_ = 0;
  // The soonest deadline a push set since the expiry loop last woke
  // (ShardCore::SetWakeup).
  Mutex wake_mu_;
  absl::Time wake_at_ ABSL_GUARDED_BY(wake_mu_) = absl::InfiniteFuture();
  // Last, so that it is destroyed first: its thread finishes the checkpoint
  // in hand and calls back into mu_ and durable_steps_ before they go (a
  // race ThreadSanitizer found when it was declared before them).
  std::unique_ptr<CheckpointThread> checkpoints_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_SHARD_RUNTIME_H_
