// ShardDaemon: everything morse-server runs for one shard, from its options
// to a clean shutdown: the shard (ShardHost, created at start or at the
// first worker's Join), its runtime (checkpoints, the state log, progress
// and stall lines, expiry), the gRPC service with health and reflection, the
// optional probe and metrics endpoints, and SIGINT/SIGTERM handling.
//
//   auto daemon = ShardDaemon::Start(options);   // serving on return
//   daemon->Run();                               // until a signal
//
// Start's errors carry the exit code's meaning (docs/operations.md):
// INVALID_ARGUMENT for options or config that will not work (exit 2),
// UNAVAILABLE for an address it cannot serve on (exit 3, retryable).
#ifndef MORSE_SERVER_SHARD_DAEMON_H_
#define MORSE_SERVER_SHARD_DAEMON_H_

#include <atomic>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "proto/http_endpoint.h"
#include "proto/job_config.h"
#include "proto/security.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/shard_host.h"
#include "server/shard_runtime.h"

namespace morse::server {

struct ShardDaemonOptions {
  proto::JobSpec job;
  uint32_t shard = 0;
  std::string listen = "127.0.0.1:7000";  // port 0: the kernel picks one
  std::string checkpoint;  // this shard's checkpoint file; empty: none
  std::string state_log;   // a JSON line per step with the mirror's checksum
  std::string metrics_listen;  // Prometheus and health over HTTP
  std::string health_listen;   // the gRPC health service alone, plaintext
  uint64_t max_model_elems = 0;
  int compute_threads = 0;
  proto::SecurityOptions security;
};

class ShardDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<ShardDaemon>> Start(
      ShardDaemonOptions options);
  // What Start refuses before it serves (INVALID_ARGUMENT): the shard out
  // of the job, the security policy, an address that is not HOST:PORT.
  // For --check_config.
  static absl::Status Check(const ShardDaemonOptions& options);
  ~ShardDaemon();
  ShardDaemon(const ShardDaemon&) = delete;
  ShardDaemon& operator=(const ShardDaemon&) = delete;

  // Serves until SIGINT or SIGTERM, then shuts down gracefully (in-flight
  // calls get 5 s) and writes the shard's last checkpoint when it is
  // between steps.
  void Run();

  // What morse-server prints about the shard: its range and partitions, or
  // that the model's size comes from the workers.
  static std::string Describe(const proto::JobSpec& job, uint32_t shard,
                              const ShardCore* core);
  // The security in words ("TLS with client certificates, bearer token").
  static std::string SecuritySummary(const proto::SecurityOptions& security);

 private:
  explicit ShardDaemon(ShardDaemonOptions options);
  absl::Status Serve();

  const ShardDaemonOptions options_;
  std::unique_ptr<std::ofstream> state_log_;
  std::unique_ptr<ShardRuntime> runtime_;
  std::unique_ptr<ShardHost> host_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<proto::HttpEndpoint> http_;
  std::unique_ptr<proto::TokenFile> tokens_;
  std::unique_ptr<ParameterServerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::atomic<bool> stopping_{false};
  std::thread expirer_;  // steps whose pushes do not all arrive in time fail
};

}  // namespace morse::server

#endif  // MORSE_SERVER_SHARD_DAEMON_H_
