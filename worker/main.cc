// morse-worker: one worker of a Morse job.
//
//   morse-worker --config job.textproto --rank 0 --servers
//   127.0.0.1:7000,127.0.0.1:7001
//
// Trains the job's workload with its optimizer through the shards, printing
// a progress line every log_every steps and a one-line JSON summary at the
// end.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "compress/compute_pool.h"
#include "compress/trace.h"
#include "proto/flags.h"
#include "proto/job_config.h"
#include "proto/process_memory.h"
#include "proto/security.h"
#include "proto/security_flags.h"
#include "proto/wire.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, config, "",
          "Job config file (text-format or JSON JobConfig). Required.");
ABSL_FLAG(int, rank, -1, "This worker's rank, 0..workers-1. Required.");
ABSL_FLAG(
    std::string, servers, "",
    "Comma-separated host:port of every shard, in shard order. Required.");
ABSL_FLAG(std::string, metrics, "",
          "Write one JSON line per step to this file.");
ABSL_FLAG(bool, checksums, false,
          "Add a checksum of x, m, v to every metrics line (a pass over the "
          "model per step).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for this worker's checkpoint (worker-<rank>.ckpt: its "
          "x, m, v and error buffer), written "
          "every checkpoint.every_steps steps; default: the config's "
          "checkpoint.dir. Made at start if missing.");
ABSL_FLAG(bool, resume, false,
          "Join a job whose servers hold its state (restarted from "
          "checkpoints, or running): from this worker's checkpoint if it holds "
          "a step the shards have reached (replaying the steps since with the "
          "replies the shards kept: a worker killed and restarted ends "
          "bit-identical), else x, m, v from the shards at their step with the "
          "error buffer from a checkpoint of that step if there is one (from "
          "zero otherwise, saying so).");
ABSL_FLAG(std::string, device, "auto",
          "Where the model, optimizer state, error buffer and gradient live: "
          "auto (the GPU "
          "when one is present and the job can run there, else the CPU, saying "
          "why), cpu, or "
          "cuda (the GPU, or exit 2 saying why not). CPU and GPU workers can "
          "share a job.");
ABSL_FLAG(bool, rejoin, false,
          "Resume (as --resume) if the shards already hold the job's model, "
          "start fresh "
          "otherwise: for workers that a supervisor (systemd, a Kubernetes "
          "Job) restarts.");
ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus /metrics, /healthz and /readyz (ready once joined) "
          "over plain "
          "HTTP on host:port (off when empty).");
ABSL_FLAG(int, compute_threads, 0,
          "Threads that encode the step's partitions (on the CPU) and apply "
          "the shards' replies, "
          "partitions in parallel and overlapping the gradient (docs/design.md "
          "7). 0: one per "
          "core this process may run on. The results are bit-identical "
          "whatever the count.");
ABSL_FLAG(std::string, trace, "",
          "Write a step timeline of this worker (Chrome trace-event JSON, for "
          "Perfetto or chrome://tracing) to this file when it exits; off when "
          "empty (docs/operations.md).");
ABSL_FLAG(bool, check_config, false,
          "Parse the flags and config, check what the start would refuse "
          "(addresses, --device, credentials) without reaching a shard, "
          "print a summary, and exit.");

namespace {

// Exit codes (docs/operations.md): 0 done, 1 training failed, 2 bad flags or
// config (do not retry), 3 servers unavailable or timed out (retryable).
int ExitCode(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kResourceExhausted:  // a model this host cannot hold
      return 2;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return 3;
    default:
      return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  morse::proto::KeepLargeBuffersMapped();
  morse::proto::TuneGrpcForReconnects();
  morse::proto::ParseFlags(
      argc, argv,
      "one worker of a Morse job.\n"
      "  morse-worker --config job.textproto --rank 0 "
      "--servers HOST:PORT,HOST:PORT \\\n"
      "      --tls_ca ca.pem --token_file token [--tls_cert c.pem --tls_key "
      "c.key]\n"
      "  morse-worker ... --insecure   (plaintext, on a network you trust)\n"
      "Flags may be spelled with dashes (--tls-ca) or underscores (--tls_ca).",
      "/main.cc");
  using namespace morse;
  const std::string config = absl::GetFlag(FLAGS_config);
  if (config.empty()) {
    std::fprintf(stderr, "morse-worker: --config is required (see --help)\n");
    return 2;
  }
  auto job = proto::LoadJobConfig(config);
  if (!job.ok()) {
    std::fprintf(stderr, "morse-worker: %s\n",
                 std::string(job.status().message()).c_str());
    return 2;
  }
  worker::TrainerOptions options;
  const int rank = absl::GetFlag(FLAGS_rank);
  if (rank == -1) {  // the flag's default: not given
    std::fprintf(stderr,
                 "morse-worker: --rank is required: 0..%u (the job has %u "
                 "workers)\n",
                 job->workers() - 1, job->workers());
    return 2;
  }
  if (rank < 0 || static_cast<uint32_t>(rank) >= job->workers()) {
    std::fprintf(stderr,
                 "morse-worker: --rank %d: must be in 0..%u (the job has %u "
                 "workers)\n",
                 rank, job->workers() - 1, job->workers());
    return 2;
  }
  options.rank = static_cast<uint32_t>(rank);
  options.servers =
      absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty());
  if (options.servers.size() != job->shards()) {
    std::fprintf(
        stderr,
        "morse-worker: --servers lists %zu address%s; the job has %u shard%s\n",
        options.servers.size(), options.servers.size() == 1 ? "" : "es",
        job->shards(), job->shards() == 1 ? "" : "s");
    return 2;
  }
  options.metrics_path = absl::GetFlag(FLAGS_metrics);
  options.checksums = absl::GetFlag(FLAGS_checksums);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.resume = absl::GetFlag(FLAGS_resume);
  options.rejoin = absl::GetFlag(FLAGS_rejoin);
  options.device = absl::GetFlag(FLAGS_device);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  const absl::StatusOr<int> threads = compress::ComputePool::ThreadsFromFlag(
      absl::GetFlag(FLAGS_compute_threads));
  if (!threads.ok()) {
    std::fprintf(stderr, "morse-worker: %s\n",
                 std::string(threads.status().message()).c_str());
    return 2;
  }
  options.compute_threads = *threads;
  options.security = proto::SecurityOptionsFromFlags();
  options.security.token_file =
      proto::TokenPathForRank(options.security.token_file, options.rank);
  if (absl::Status s = proto::ValidateClientSecurity(options.security);
      !s.ok()) {
    std::fprintf(stderr, "morse-worker: %s\n",
                 std::string(s.message()).c_str());
    return 2;
  }
  if (const std::string trace = absl::GetFlag(FLAGS_trace);
      !trace.empty() && !absl::GetFlag(FLAGS_check_config)) {
    if (absl::Status s = trace::Start(trace, absl::StrCat("rank ", rank));
        !s.ok()) {
      std::fprintf(stderr, "morse-worker: --trace: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_check_config)) {
    if (absl::Status s = worker::Trainer::Check(*job, options); !s.ok()) {
      std::fprintf(stderr, "morse-worker: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
    if (absl::Status s = proto::CheckFitsInMemory(
            proto::WorkerStateBytes(*job),
            absl::StrCat("worker ", rank, " (", job->algorithm.layout.dim,
                         " elements)"));
        !s.ok()) {
      std::fprintf(stderr, "morse-worker: %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
    const std::string node =
        job->local_ranks > 1
            ? absl::StrCat(" (a node of ", job->local_ranks, " local ranks)")
            : "";
    std::printf(
        "morse-worker: config OK: job '%s', rank %d of %u%s, %u shards, D = "
        "%llu, %lld steps, %s\n",
        job->name.c_str(), rank, job->workers(), node.c_str(), job->shards(),
        static_cast<unsigned long long>(job->algorithm.layout.dim),
        static_cast<long long>(job->steps),
        options.security.insecure ? "plaintext (--insecure)" : "TLS");
    return 0;
  }
  auto summary = worker::Train(*job, options);
  if (!summary.ok()) {
    std::fprintf(stderr, "morse-worker %d: %s\n", rank,
                 std::string(summary.status().message()).c_str());
    return ExitCode(summary.status());
  }
  std::printf("%s\n", summary->ToJson().c_str());
  return 0;
}
