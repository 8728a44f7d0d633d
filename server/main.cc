// morse-server: one shard of a Morse job's parameter server.
//
//   morse-server --config job.textproto --shard 0 --listen 127.0.0.1:7000
//
// Serves morse.v1.ParameterServer, the gRPC health service and server
// reflection on --listen until SIGTERM or SIGINT, then shuts down gracefully.
// TLS (--tls_cert/--tls_key, mutual with --tls_ca) and a bearer token
// (--token_file) protect it; plaintext needs --insecure.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/compute_pool.h"
#include "compress/trace.h"
#include "proto/checkpoint_file.h"
#include "proto/flags.h"
#include "proto/job_config.h"
#include "proto/process_memory.h"
#include "proto/security.h"
#include "proto/security_flags.h"
#include "server/shard_core.h"
#include "server/shard_daemon.h"

ABSL_FLAG(std::string, config, "",
          "Job config file (text-format or JSON JobConfig). Required.");
ABSL_FLAG(int, shard, -1,
          "Which shard of the job this server holds, 0..shards-1. Required.");
ABSL_FLAG(std::string, listen, "127.0.0.1:7000",
          "Address to serve on, host:port (0.0.0.0:PORT for every interface; "
          "port 0 picks a "
          "free port and prints it).");
ABSL_FLAG(
    std::string, state_log, "",
    "If set, append one JSON line per completed step to this file with the "
    "mirror's "
    "checksum of x, m, v (costs a pass over the shard per step; for tests).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for this shard's checkpoint (shard-<s>.ckpt); default: "
          "the config's "
          "checkpoint.dir, made at start if missing. If a checkpoint is "
          "there at start, the shard resumes from it. Written "
          "every checkpoint.every_steps steps and at shutdown when the shard "
          "is between steps.");
ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus /metrics, /healthz and /readyz over plain HTTP on "
          "host:port "
          "(off when empty).");
ABSL_FLAG(std::string, health_listen, "",
          "Also serve the gRPC health service, and nothing else, in plaintext "
          "on host:port "
          "(for kubelet gRPC probes, which cannot speak TLS); off when empty.");
ABSL_FLAG(uint64_t, max_model_elems, 0,
          "The largest model (elements) an external job's first Join may size "
          "this shard for; "
          "larger ones are refused with RESOURCE_EXHAUSTED. 0: no limit but "
          "this host's memory, "
          "which is always checked.");
ABSL_FLAG(int, compute_threads, 0,
          "Threads that average and recompress completed partitions, "
          "partitions in parallel, "
          "off gRPC's threads (docs/design.md 7). 0: one per core this process "
          "may run on. "
          "Replies are bit-identical whatever the count.");
ABSL_FLAG(std::string, trace, "",
          "Write a step timeline of this shard (Chrome trace-event JSON, for "
          "Perfetto or chrome://tracing) to this file when it exits; off when "
          "empty (docs/operations.md).");
ABSL_FLAG(bool, check_config, false,
          "Parse the flags and config, check what the start would refuse "
          "(--shard, addresses, the TLS policy) without serving, print a "
          "summary, and exit.");

namespace {

// Exit codes (docs/operations.md): 0 done, 2 bad flags or config (do not
// retry), 3 cannot serve (address in use; retryable).
constexpr int kExitConfig = 2;
constexpr int kExitUnavailable = 3;

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "morse-server: %s\n", message.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  morse::proto::KeepLargeBuffersMapped();
  morse::proto::ParseFlags(
      argc, argv,
      "one shard of a Morse parameter server.\n"
      "  morse-server --config job.textproto --shard 0 --listen 127.0.0.1:7000",
      "/main.cc");
  using namespace morse;
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (config_path.empty())
    return Fail(kExitConfig, "--config is required (see --help)");
  auto job = proto::LoadJobConfig(config_path);
  if (!job.ok()) return Fail(kExitConfig, std::string(job.status().message()));
  const int shard = absl::GetFlag(FLAGS_shard);
  if (shard == -1) {  // the flag's default: not given
    return Fail(kExitConfig,
                absl::StrFormat("--shard is required: 0..%u (the job has %u "
                                "shards)",
                                job->shards() - 1, job->shards()));
  }
  if (shard < 0 || shard >= static_cast<int>(job->shards())) {
    return Fail(kExitConfig,
                absl::StrFormat("--shard %d: must be in 0..%u (the job has %u "
                                "shards)",
                                shard, job->shards() - 1, job->shards()));
  }
  const absl::StatusOr<int> threads = compress::ComputePool::ThreadsFromFlag(
      absl::GetFlag(FLAGS_compute_threads));
  if (!threads.ok())
    return Fail(kExitConfig, std::string(threads.status().message()));
  const int compute_threads = *threads;
  const proto::SecurityOptions security = proto::SecurityOptionsFromFlags();
  if (const std::string trace = absl::GetFlag(FLAGS_trace);
      !trace.empty() && !absl::GetFlag(FLAGS_check_config)) {
    if (absl::Status s = trace::Start(trace, absl::StrCat("shard ", shard));
        !s.ok()) {
      return Fail(kExitConfig, absl::StrCat("--trace: ", s.message()));
    }
  }
  server::ShardDaemonOptions options;
  options.job = *job;
  options.shard = static_cast<uint32_t>(shard);
  options.listen = absl::GetFlag(FLAGS_listen);
  options.state_log = absl::GetFlag(FLAGS_state_log);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.max_model_elems = absl::GetFlag(FLAGS_max_model_elems);
  options.compute_threads = compute_threads;
  options.security = security;
  if (absl::GetFlag(FLAGS_check_config)) {
    if (absl::Status s = server::ShardDaemon::Check(options); !s.ok())
      return Fail(kExitConfig, std::string(s.message()));
    std::unique_ptr<server::ShardCore> core;
    if (job->sized()) {
      auto created =
          server::ShardCore::Create(*job, static_cast<uint32_t>(shard));
      if (!created.ok())
        return Fail(kExitConfig, std::string(created.status().message()));
      core = *std::move(created);
    }
    std::printf("morse-server: config OK: %s; %s\n",
                server::ShardDaemon::Describe(*job, shard, core.get()).c_str(),
                server::ShardDaemon::SecuritySummary(security).c_str());
    return 0;
  }

  std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (checkpoint_dir.empty()) checkpoint_dir = job->checkpoint_dir;
  if (!checkpoint_dir.empty()) {
    if (absl::Status s = proto::MakeCheckpointDir(checkpoint_dir); !s.ok())
      return Fail(kExitConfig, std::string(s.message()));
    options.checkpoint =
        absl::StrCat(checkpoint_dir, "/shard-", shard, ".ckpt");
  }
  auto daemon = server::ShardDaemon::Start(std::move(options));
  if (!daemon.ok()) {
    return Fail(daemon.status().code() == absl::StatusCode::kUnavailable
                    ? kExitUnavailable
                    : kExitConfig,
                std::string(daemon.status().message()));
  }
  (*daemon)->Run();
  return 0;
}
