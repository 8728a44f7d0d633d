// morse-server: one shard of a Morse job's parameter server.
//
//   morse-server --config job.textproto --shard 0 --listen 127.0.0.1:7000
//
// Serves morse.v1.ParameterServer, the gRPC health service and server
// reflection on --listen until SIGTERM or SIGINT, then shuts down gracefully.
// TLS (--tls_cert/--tls_key, mutual with --tls_ca) and a bearer token
// (--token_file) protect it; plaintext needs --insecure.
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/signal_set.hpp"
#include "compress/compute_pool.h"
#include "compress/kernels.h"
#include "compress/trace.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/flags.h"
#include "proto/http_endpoint.h"
#include "proto/job_config.h"
#include "proto/security.h"
#include "proto/security_flags.h"
#include "proto/wire.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/shard_core.h"
#include "server/shard_host.h"
#include "server/shard_runtime.h"

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
          "checkpoint.dir. If a checkpoint is there at start, the shard "
          "resumes from it. Written "
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
          "Parse the flags and config, print a summary, and exit.");

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
  if (shard < 0) return Fail(kExitConfig, "--shard is required (0..shards-1)");
  const absl::StatusOr<int> threads = compress::ComputePool::ThreadsFromFlag(
      absl::GetFlag(FLAGS_compute_threads));
  if (!threads.ok())
    return Fail(kExitConfig, std::string(threads.status().message()));
  const int compute_threads = *threads;
  if (shard >= static_cast<int>(job->shards())) {
    return Fail(kExitConfig,
                absl::StrFormat("--shard %d: the job has %u shards", shard,
                                job->shards()));
  }
  const auto describe = [&](const proto::JobSpec& j,
                            const server::ShardCore* core) {
    if (core == nullptr) {
      return absl::StrFormat(
          "shard %d/%u of job '%s': model size from the workers, %u workers",
          shard, j.shards(), j.name, j.workers());
    }
    const server::ShardStatus s = core->Status();
    return absl::StrFormat(
        "shard %d/%u of job '%s': elements [%u, %u) in %u partitions, %u "
        "workers, layout %x",
        shard, j.shards(), j.name, s.range.begin, s.range.end, s.partitions,
        j.workers(), s.layout_fingerprint);
  };
  const proto::SecurityOptions security = proto::SecurityOptionsFromFlags();
  if (absl::Status s = proto::ValidateServerSecurity(security); !s.ok()) {
    return Fail(kExitConfig, std::string(s.message()));
  }
  const std::string security_summary =
      security.insecure
          ? absl::StrCat("plaintext (--insecure)",
                         security.token_file.empty() ? "" : ", bearer token")
          : absl::StrCat(
                "TLS",
                security.tls_ca.empty() ? "" : " with client certificates",
                security.token_file.empty() ? "" : ", bearer token");
  if (const std::string trace = absl::GetFlag(FLAGS_trace);
      !trace.empty() && !absl::GetFlag(FLAGS_check_config)) {
    if (absl::Status s = trace::Start(trace, absl::StrCat("shard ", shard));
        !s.ok()) {
      return Fail(kExitConfig, absl::StrCat("--trace: ", s.message()));
    }
  }
  if (absl::GetFlag(FLAGS_check_config)) {
    std::unique_ptr<server::ShardCore> core;
    if (job->sized()) {
      auto created =
          server::ShardCore::Create(*job, static_cast<uint32_t>(shard));
      if (!created.ok())
        return Fail(kExitConfig, std::string(created.status().message()));
      core = *std::move(created);
    }
    std::printf("morse-server: config OK: %s; %s\n",
                describe(*job, core.get()).c_str(), security_summary.c_str());
    return 0;
  }

  std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (checkpoint_dir.empty()) checkpoint_dir = job->checkpoint_dir;
  const std::string checkpoint =
      checkpoint_dir.empty()
          ? ""
          : absl::StrCat(checkpoint_dir, "/shard-", shard, ".ckpt");
  std::unique_ptr<std::ofstream> state_log;
  if (!absl::GetFlag(FLAGS_state_log).empty()) {
    state_log = std::make_unique<std::ofstream>(absl::GetFlag(FLAGS_state_log),
                                                std::ios::app);
    if (!*state_log)
      return Fail(kExitConfig,
                  "cannot open --state_log " + absl::GetFlag(FLAGS_state_log));
  }
  // Checkpoints, the state log, progress and stall lines, step metrics and
  // expiry: server/shard_runtime.h.
  server::ShardRuntime runtime(
      {static_cast<uint32_t>(shard), checkpoint, state_log.get(), nullptr});
  // Runs once the model's size is known: at start for built-in workloads,
  // at the first worker's Join for external (PyTorch) models.
  const auto on_configured = [&](const proto::JobSpec& j,
                                 server::ShardCore& core) -> absl::Status {
    if (absl::Status s = runtime.OnConfigured(j, core); !s.ok()) return s;
    std::printf("morse-server: %s\n", describe(j, &core).c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  };
  auto host = server::ShardHost::Create(
      *job, static_cast<uint32_t>(shard), on_configured,
      absl::GetFlag(FLAGS_max_model_elems), compute_threads);
  if (!host.ok())
    return Fail(kExitConfig, std::string(host.status().message()));

  std::unique_ptr<server::ServerMetrics> metrics;
  std::unique_ptr<proto::HttpEndpoint> http;
  if (!absl::GetFlag(FLAGS_metrics_listen).empty()) {
    metrics = std::make_unique<server::ServerMetrics>(
        std::make_shared<prometheus::Registry>(), shard);
    auto endpoint = proto::HttpEndpoint::Start(
        absl::GetFlag(FLAGS_metrics_listen), metrics->registry(), [&host] {
          server::ShardCore* core = (*host)->core();
          if (core == nullptr) return false;
          const server::ShardStatus s = core->Status();
          return s.partitions_initialized == s.partitions;
        });
    if (!endpoint.ok())
      return Fail(kExitUnavailable, std::string(endpoint.status().message()));
    http = *std::move(endpoint);
    std::printf(
        "morse-server shard %d: metrics on http://%s/metrics (port %d)\n",
        shard, absl::GetFlag(FLAGS_metrics_listen).c_str(), http->port());
  }
  runtime.SetMetrics(metrics.get());
  auto tokens = proto::TokenFile::FromOptions(security);
  if (!tokens.ok())
    return Fail(kExitConfig, std::string(tokens.status().message()));
  server::ParameterServerService service(host->get(), metrics.get(),
                                         tokens->get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen),
                           proto::MakeServerCredentials(security), &port);
  builder.SetMaxReceiveMessageSize(proto::MaxMessageBytes(*job));
  builder.SetMaxSendMessageSize(proto::MaxMessageBytes(*job));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(kExitUnavailable,
                "cannot listen on " + absl::GetFlag(FLAGS_listen));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  // The probe port: a second server holding only the health service.
  std::unique_ptr<grpc::Server> health_server;
  if (!absl::GetFlag(FLAGS_health_listen).empty()) {
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(absl::GetFlag(FLAGS_health_listen),
                                    grpc::InsecureServerCredentials(),
                                    &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      return Fail(kExitUnavailable, "cannot serve health on " +
                                        absl::GetFlag(FLAGS_health_listen));
    }
    health_server->GetHealthCheckService()->SetServingStatus(true);
    std::printf("morse-server shard %d: gRPC health on %s\n", shard,
                absl::GetFlag(FLAGS_health_listen).c_str());
  }
  // With port 0 the kernel picks one; print the real address for scripts.
  std::string address = absl::GetFlag(FLAGS_listen);
  address = address.substr(0, address.rfind(':') + 1) + std::to_string(port);
  std::printf(
      "morse-server: %s; %s; %d compute threads, %s kernels; listening on %s\n",
      describe(*job, (*host)->core()).c_str(), security_summary.c_str(),
      compute_threads, compress::ActiveKernels().name, address.c_str());
  std::fflush(stdout);

  // Steps whose pushes do not all arrive in time fail instead of hanging.
  std::atomic<bool> stopping{false};
  std::thread expirer([&] {
    while (!stopping.load()) {
      if (server::ShardCore* core = (*host)->core())
        runtime.Tick(*core, absl::Now());
      absl::SleepFor(absl::Milliseconds(200));
    }
  });

  boost::asio::io_context io;
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code&, int signal) {
    std::printf("morse-server shard %d: signal %d, shutting down\n", shard,
                signal);
    std::fflush(stdout);
    server->GetHealthCheckService()->SetServingStatus(false);
    if (health_server)
      health_server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
  });
  std::thread signal_thread([&] { io.run(); });
  server->Wait();
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  stopping = true;
  io.stop();
  signal_thread.join();
  expirer.join();
  runtime.Shutdown((*host)->core());
  return 0;
}
