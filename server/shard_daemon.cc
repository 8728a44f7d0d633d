#include "server/shard_daemon.h"

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/signal_set.hpp"
#include "compress/kernels.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/address.h"
#include "proto/wire.h"

namespace morse::server {
namespace {

// Start's errors say which exit code they mean: INVALID_ARGUMENT (2) keeps
// the message of whatever else went wrong with the options or config.
absl::Status ConfigError(const absl::Status& status) {
  return absl::InvalidArgumentError(status.message());
}

// A port gRPC could not bind: without SO_REUSEPORT, a second daemon on a
// taken address lands here (exit 3).
absl::Status CannotListen(absl::string_view what, absl::string_view address) {
  return absl::UnavailableError(
      absl::StrCat("cannot ", what, " on ", address,
                   " (in use by another process, or not this host's address)"));
}

}  // namespace

std::string ShardDaemon::Describe(const proto::JobSpec& job, uint32_t shard,
                                  const ShardCore* core) {
  // An elastic job's steps complete with min_workers of them.
  const std::string elastic =
      job.elastic() ? absl::StrFormat(" (elastic: at least %u, min_workers)",
                                      job.min_workers)
                    : "";
  if (core == nullptr) {
    return absl::StrFormat(
        "shard %d/%u of job '%s': model size from the workers, %u workers%s",
        shard, job.shards(), job.name, job.workers(), elastic);
  }
  const ShardStatus s = core->Status();
  return absl::StrFormat(
      "shard %d/%u of job '%s': elements [%u, %u) in %u partitions, %u "
      "workers%s, layout %x",
      shard, job.shards(), job.name, s.range.begin, s.range.end, s.partitions,
      job.workers(), elastic, s.layout_fingerprint);
}

std::string ShardDaemon::SecuritySummary(
    const proto::SecurityOptions& security) {
  if (security.insecure) {
    return absl::StrCat("plaintext (--insecure)",
                        security.token_file.empty() ? "" : ", bearer token");
  }
  return absl::StrCat(
      "TLS", security.tls_ca.empty() ? "" : " with client certificates",
      security.token_file.empty() ? "" : ", bearer token");
}

ShardDaemon::ShardDaemon(ShardDaemonOptions options)
    : options_(std::move(options)) {}

absl::Status ShardDaemon::Check(const ShardDaemonOptions& options) {
  if (options.shard >= options.job.shards()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--shard %d: the job has %u shards", options.shard,
                        options.job.shards()));
  }
  if (absl::Status s = proto::ValidateServerSecurity(options.security);
      !s.ok()) {
    return ConfigError(s);
  }
  const struct {
    const char* flag;
    const std::string& address;
    bool required;
  } addresses[] = {{"--listen", options.listen, true},
                   {"--metrics_listen", options.metrics_listen, false},
                   {"--health_listen", options.health_listen, false}};
  for (const auto& a : addresses) {
    if (a.address.empty() && !a.required) continue;  // off
    if (auto split = proto::SplitHostPort(a.address, a.flag); !split.ok()) {
      return ConfigError(split.status());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShardDaemon>> ShardDaemon::Start(
    ShardDaemonOptions options) {
  if (absl::Status s = Check(options); !s.ok()) return s;
  std::unique_ptr<ShardDaemon> daemon(new ShardDaemon(std::move(options)));
  if (absl::Status s = daemon->Serve(); !s.ok()) return s;
  return daemon;
}

absl::Status ShardDaemon::Serve() {
  const ShardDaemonOptions& o = options_;
  if (!o.state_log.empty()) {
    state_log_ = std::make_unique<std::ofstream>(o.state_log, std::ios::app);
    if (!*state_log_) {
      return absl::InvalidArgumentError("cannot open --state_log " +
                                        o.state_log);
    }
  }
  // Checkpoints, the state log, progress and stall lines, step metrics and
  // expiry: server/shard_runtime.h.
  runtime_ = std::make_unique<ShardRuntime>(
      ShardRuntime::Options{o.shard, o.checkpoint, state_log_.get(), nullptr});
  // Runs once the model's size is known: at start for built-in workloads,
  // at the first worker's Join for external (PyTorch) models.
  const auto on_configured = [this](const proto::JobSpec& job, ShardCore& core,
                                    bool relaid) -> absl::Status {
    if (absl::Status s = runtime_->OnConfigured(job, core, relaid); !s.ok())
      return s;
    std::printf("morse-server: %s\n",
                Describe(job, options_.shard, &core).c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  };
  auto host = ShardHost::Create(o.job, o.shard, on_configured,
                                o.max_model_elems, o.compute_threads);
  if (!host.ok()) return ConfigError(host.status());
  host_ = *std::move(host);

  if (!o.metrics_listen.empty()) {
    metrics_ = std::make_unique<ServerMetrics>(
        std::make_shared<prometheus::Registry>(), o.shard);
    ShardHost* shard_host = host_.get();
    auto endpoint = proto::HttpEndpoint::Start(
        o.metrics_listen, metrics_->registry(), [shard_host] {
          std::shared_ptr<ShardCore> core = shard_host->core();
          if (core == nullptr) return false;
          const ShardStatus s = core->Status();
          return s.partitions_initialized == s.partitions;
        });
    if (!endpoint.ok())
      return absl::UnavailableError(endpoint.status().message());
    http_ = *std::move(endpoint);
    std::printf(
        "morse-server shard %d: metrics on http://%s/metrics (port %d)\n",
        o.shard, o.metrics_listen.c_str(), http_->port());
  }
  runtime_->SetMetrics(metrics_.get());
  auto tokens = proto::TokenFile::FromOptions(o.security);
  if (!tokens.ok()) return ConfigError(tokens.status());
  tokens_ = *std::move(tokens);
  service_ = std::make_unique<ParameterServerService>(
      host_.get(), metrics_.get(), tokens_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.listen, proto::MakeServerCredentials(o.security),
                           &port);
  // A port another process listens on is refused: with SO_REUSEPORT
  // (gRPC's default on Linux) a second shard on the same address would
  // answer some of the workers, which could join another job's shard.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  proto::AcceptKeepalive(builder);  // the workers' (proto::ChannelArgs)
  builder.SetMaxReceiveMessageSize(proto::MaxMessageBytes(o.job));
  builder.SetMaxSendMessageSize(proto::MaxMessageBytes(o.job));
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return CannotListen("listen", o.listen);
  }
  server_->GetHealthCheckService()->SetServingStatus(true);
  // The probe port: a second server holding only the health service.
  if (!o.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(
        o.health_listen, grpc::InsecureServerCredentials(), &health_port);
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_server_ = health_builder.BuildAndStart();
    if (health_server_ == nullptr || health_port == 0) {
      return CannotListen("serve health", o.health_listen);
    }
    health_server_->GetHealthCheckService()->SetServingStatus(true);
    std::printf("morse-server shard %d: gRPC health on %s\n", o.shard,
                o.health_listen.c_str());
  }
  // With port 0 the kernel picks one; print the real address for scripts.
  const std::string address =
      o.listen.substr(0, o.listen.rfind(':') + 1) + std::to_string(port);
  std::printf(
      "morse-server: %s; %s; %d compute threads, %s kernels; listening on %s\n",
      Describe(o.job, o.shard, host_->core().get()).c_str(),
      SecuritySummary(o.security).c_str(), o.compute_threads,
      compress::ActiveKernels().name, address.c_str());
  std::fflush(stdout);
  expirer_ = std::thread([this] {
    while (!stopping_.load()) {
      std::shared_ptr<ShardCore> core = host_->core();
      if (core != nullptr) runtime_->Tick(*core, absl::Now());
      runtime_->AwaitTick(core.get(), absl::Milliseconds(200));
    }
  });
  return absl::OkStatus();
}

void ShardDaemon::Run() {
  boost::asio::io_context io;
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([this](const boost::system::error_code&, int signal) {
    std::printf("morse-server shard %d: signal %d, shutting down\n",
                options_.shard, signal);
    std::fflush(stdout);
    server_->GetHealthCheckService()->SetServingStatus(false);
    if (health_server_)
      health_server_->GetHealthCheckService()->SetServingStatus(false);
    // Pushes waiting for other workers would hold the shutdown until their
    // step ends (or expires): they are answered now, and later ones at once.
    if (std::shared_ptr<ShardCore> core = host_->core()) {
      core->Stop(absl::UnavailableError(absl::StrFormat(
          "shard %d is shutting down (signal %d); a restarted shard takes "
          "the step again",
          options_.shard, signal)));
    }
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(5));
  });
  std::thread signal_thread([&io] { io.run(); });
  server_->Wait();
  if (health_server_)
    health_server_->Shutdown(std::chrono::system_clock::now());
  stopping_ = true;
  io.stop();
  signal_thread.join();
  expirer_.join();
  runtime_->Shutdown(host_->core().get());
}

ShardDaemon::~ShardDaemon() {
  // Start failed part way, or Run never ran: stop what started.
  stopping_ = true;
  if (expirer_.joinable()) expirer_.join();
  if (health_server_) health_server_->Shutdown();
  if (server_) server_->Shutdown();
}

}  // namespace morse::server
