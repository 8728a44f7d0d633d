// InProcessCluster: the S shards of one job inside the test's process —
// each a ShardHost with its ShardRuntime (checkpoints, expiry) and the
// ShardHandler the gRPC service would call — and Transports
// (worker/transport/transport.h) that reach them by calling those handlers
// directly. N Sessions over Connect() then run a whole job in one process,
// with no sockets, under any sanitizer; FaultyTransport (faults.h) wraps a
// transport to inject failures, and Kill/Restart stop a shard and bring it
// back from its checkpoint as a supervisor would.
//
// What the transport keeps from the wire: every call's request is copied
// (the shard owns its copy, as over a socket); replies and errors come back
// on the cluster's delivery threads, never on the caller's; a call to a
// killed shard fails with UNAVAILABLE ("connection refused"), a push left
// waiting in a killed shard with DEADLINE_EXCEEDED at its deadline, as over
// gRPC; status payloads travel as they are (proto/wire.h). Thread-safe.
#ifndef MORSE_TESTS_INPROC_CLUSTER_H_
#define MORSE_TESTS_INPROC_CLUSTER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/compute_pool.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "server/handler.h"
#include "server/shard_host.h"
#include "server/shard_runtime.h"
#include "worker/timer.h"
#include "worker/transport/transport.h"

namespace morse::inproc {

// A fresh directory for a test's checkpoints under the test's temporary
// directory, named prefix-XXXXXX; "" if it cannot be made.
std::string MakeTempDir(const std::string& prefix);

struct PendingPush;

class InProcessCluster {
 public:
  struct Options {
    // Where shard-<s>.ckpt go (the job's checkpoint.every_steps); empty: no
    // checkpoints, and Restart starts a shard with no state.
    std::string checkpoint_dir;
    int compute_threads = 0;   // each shard core's pool (ShardCore::Create)
    int delivery_threads = 2;  // threads that run the calls' callbacks
  };

  // Starts every shard (a sized job: the synthetic or mlp workload, or dim).
  static absl::StatusOr<std::unique_ptr<InProcessCluster>> Create(
      const proto::JobSpec& job, Options options);
  ~InProcessCluster();
  InProcessCluster(const InProcessCluster&) = delete;
  InProcessCluster& operator=(const InProcessCluster&) = delete;

  // A transport to every shard, for one worker.
  std::unique_ptr<worker::Transport> Connect();

  // Shard s dies as under kill -9: what it holds in memory is lost, its
  // checkpoint on disk stays, and calls fail UNAVAILABLE until Restart.
  void Kill(uint32_t shard);
  // A new shard s from its checkpoint (ShardRuntime::OnConfigured), as its
  // supervisor would start it.
  absl::Status Restart(uint32_t shard);

  // Shard s's mirror checksum and completed steps (call between steps);
  // FAILED_PRECONDITION while it is killed.
  absl::StatusOr<uint64_t> MirrorChecksum(uint32_t shard);
  absl::StatusOr<int64_t> CompletedSteps(uint32_t shard);

  // The shards' progress lines so far (ShardRuntime's log), one per entry.
  std::vector<std::string> log() const;

  const proto::JobSpec& job() const { return job_; }

 private:
  struct Shard;
  class ClusterTransport;
  friend class ClusterTransport;

  InProcessCluster(const proto::JobSpec& job, Options options);
  absl::StatusOr<std::shared_ptr<Shard>> Start(uint32_t shard);
  // The live shard s, or null while killed.
  std::shared_ptr<Shard> Get(uint32_t shard) const;
  void Tick();
  // Finishes a push with `result` on a delivery thread, unless something
  // finished it first.
  void Finish(const std::shared_ptr<PendingPush>& pending,
              absl::StatusOr<std::shared_ptr<const server::Reply>> result);

  const proto::JobSpec job_;
  const Options options_;
  mutable Mutex mu_;
  std::vector<std::shared_ptr<Shard>> shards_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
  compress::ComputePool
      delivery_;         // calls' callbacks; destroyed after the timer
  worker::Timer timer_;  // calls' deadlines
  std::atomic<bool> stopping_{false};
  std::thread ticker_;  // ShardRuntime::Tick, as morse-server's expiry thread
};

}  // namespace morse::inproc

#endif  // MORSE_TESTS_INPROC_CLUSTER_H_
