#include "worker/trainer.h"

#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "compress/error_feedback.h"
#include "compress/replica.h"
#include "proto/checkpoint_file.h"
#include "proto/http_endpoint.h"
#include "prometheus/registry.h"
#include "worker/client.h"
#include "worker/session.h"
#include "worker/step_report.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

// Bytes this process's TCP sockets have sent (acknowledged by the peer) and
// received, summed over the sockets open now (Linux TCP_INFO): what went over
// the wire, framing and all, as opposed to payload bytes.
struct TcpCounters {
  uint64_t sent = 0, received = 0;
};

TcpCounters ReadTcpCounters() {
  TcpCounters c;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return c;
  while (dirent* entry = readdir(dir)) {
    const int fd = std::atoi(entry->d_name);
    struct stat st;
    if (fd <= 2 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
    c.sent += info.tcpi_bytes_acked;
    c.received += info.tcpi_bytes_received;
  }
  closedir(dir);
  return c;
}

}  // namespace

std::string TrainingSummary::ToJson() const {
  std::string json = absl::StrFormat(
      "{\"rank\":%u,\"steps\":%d,\"final_loss\":%.6g,\"payload_up_bytes\":%u,"
      "\"payload_down_bytes\":%u,\"warmup_up_bytes_per_step\":%u,"
      "\"compressed_up_bytes_per_step\":%u,\"exchanges\":%d,\"wire_sent_bytes\":%u,\"wire_received_bytes\":%u,"
      "\"wall_seconds\":%.3f,\"comm_seconds\":%.3f,\"checksum\":\"%016x\",\"device\":\"%s\"",
      rank, steps, final_loss, payload_up, payload_down, warmup_up_per_step,
      compressed_up_per_step, exchanges, wire_sent_bytes, wire_received_bytes, wall_seconds, comm_seconds,
      final_checksum, device);
  if (test_accuracy.has_value()) absl::StrAppendFormat(&json, ",\"test_accuracy\":%.4f", *test_accuracy);
  return json + "}";
}

namespace {

// Moves the session to the engine options.device names and gives the engine
// the workload's gradient: "cuda" or the GPU for "auto" when there is one
// and the job can run there (saying why not and staying on the CPU for
// "auto"), else the CPU.
absl::Status ChooseEngine(const TrainerOptions& options, Workload& workload, Session& session) {
  if (options.device != "auto" && options.device != "cpu" && options.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", options.device, ": use auto, cpu or cuda"));
  }
  if (options.device != "cpu") {
    absl::Status moved = session.MoveTo("cuda");
    if (moved.ok()) moved = session.engine().SetWorkload(workload);
    if (moved.ok()) {
      std::printf("worker %u: x, m, v, error buffer and gradient on %s\n", options.rank,
                  session.engine().description().c_str());
      return absl::OkStatus();
    }
    if (options.device == "cuda") {
      return absl::Status(moved.code(), absl::StrCat("--device cuda: ", moved.message()));
    }
    std::printf("worker %u: training on the CPU (%s)\n", options.rank, std::string(moved.message()).c_str());
    if (session.engine().kind() != "cpu") {
      if (absl::Status s = session.MoveTo("cpu"); !s.ok()) return s;
    }
  }
  return session.engine().SetWorkload(workload);
}

}  // namespace

absl::StatusOr<TrainingSummary> Train(const proto::JobSpec& job, const TrainerOptions& options) {
  auto workload = MakeWorkload(job, options.rank);
  if (!workload.ok()) return workload.status();
  const uint64_t dim = job.algorithm.layout.dim;
  if ((*workload)->dim() != dim) {
    return absl::InternalError(absl::StrCat("workload has ", (*workload)->dim(), " parameters, the layout ", dim));
  }
  // Metrics (--metrics_listen): morse_worker_* series (worker/step_report.h).
  std::unique_ptr<WorkerMetrics> prometheus_metrics;
  std::unique_ptr<proto::HttpEndpoint> http;
  std::atomic<bool> ready{false};
  if (!options.metrics_listen.empty()) {
    prometheus_metrics = std::make_unique<WorkerMetrics>(std::make_shared<prometheus::Registry>(), options.rank);
    auto endpoint = proto::HttpEndpoint::Start(options.metrics_listen, prometheus_metrics->registry(),
                                               [&ready] { return ready.load(); });
    if (!endpoint.ok()) return endpoint.status();
    http = *std::move(endpoint);
  }
  auto session = Session::Connect(job, options.rank, options.servers, options.security, {},
                                  options.compute_threads);
  if (!session.ok()) return session.status();
  compress::Replica& replica = (*session)->replica();
  (*workload)->Initialize(replica.x());
  const std::string checkpoint_dir =
      options.checkpoint_dir.empty() ? job.checkpoint_dir : options.checkpoint_dir;
  const std::string checkpoint =
      checkpoint_dir.empty() ? "" : absl::StrCat(checkpoint_dir, "/worker-", options.rank, ".ckpt");
  bool resume = options.resume;
  if (options.rejoin && !resume) {
    // Ranks other than 0 take the model from the shards either way; rank 0
    // uploads it only if no one has.
    auto held = (*session)->ShardsHoldModel();
    if (!held.ok()) return held.status();
    resume = options.rank != 0 || *held;
  }
  auto first = (*session)->Start(resume, checkpoint);
  if (!first.ok()) return first.status();
  const int64_t first_step = *first;
  if (absl::Status s = ChooseEngine(options, **workload, **session); !s.ok()) return s;
  Engine& engine = (*session)->engine();
  ready = true;

  std::unique_ptr<std::ofstream> metrics;
  if (!options.metrics_path.empty()) {
    metrics = std::make_unique<std::ofstream>(options.metrics_path, std::ios::trunc);
    if (!*metrics) return absl::InvalidArgumentError("cannot write metrics file " + options.metrics_path);
  }

  TrainingSummary summary;
  summary.rank = options.rank;
  summary.device = engine.description();
  StepReport report({options.rank, job.steps, first_step, job.log_every,
                     static_cast<double>((*workload)->samples_per_step()),
                     metrics.get(), nullptr});
  const TcpCounters tcp_start = ReadTcpCounters();
  const absl::Time train_start = absl::Now();
  for (int64_t step = first_step; step < job.steps; ++step) {
    const absl::Time step_start = absl::Now();
    if (step == job.algorithm.freeze_step && job.algorithm.optimizer == compress::OptimizerKind::kOneBitAdam) {
      // v is frozen from here on: say how much the zero-variance mask holds.
      if (absl::Status s = (*session)->SyncHost(); !s.ok()) return s;
      const auto v = replica.v();
      const size_t zeros = static_cast<size_t>(std::count(v.begin(), v.end(), 0.0f));
      std::printf("worker %u: v frozen at step %lld; %zu of %zu elements have v = 0%s\n", options.rank,
                  static_cast<long long>(step), zeros, v.size(),
                  zeros == 0 ? ""
                  : job.algorithm.mask_zero_variance
                      ? " and are masked (mask_zero_variance)"
                      : ": with mask_zero_variance off they get +-scale/eps updates");
      std::fflush(stdout);
    }
    StepRecord record;
    record.step = step;
    const TcpCounters tcp_before = ReadTcpCounters();
    absl::StatusOr<double> loss;
    if (engine.ComputesGradientRanges()) {
      // Each partition is pushed as soon as its gradient is computed, so the
      // exchange overlaps the rest of the gradient.
      if (absl::Status s = (*session)->BeginFromEngine(); !s.ok()) return s;
      double lanes[4] = {0, 0, 0, 0};
      for (const compress::Partition& p : (*session)->layout().partitions()) {
        const absl::Time start = absl::Now();
        if (absl::Status s = engine.GradientRange(step, p.range.begin, p.range.end, lanes); !s.ok()) return s;
        record.compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
        if (absl::Status s = (*session)->SendPartition(p.id); !s.ok()) return s;
      }
      loss = engine.GradientRangeLoss(lanes);
      if (absl::Status s = (*session)->Finish(&record.traffic); !s.ok()) return s;
    } else {
      loss = engine.Gradient(step);
      if (!loss.ok()) return loss.status();
      record.compute_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
      if (absl::Status s = (*session)->StepFromEngine(&record.traffic); !s.ok()) return s;
    }
    record.loss = *loss;
    const bool checkpoint_due = !checkpoint.empty() && job.checkpoint_every_steps > 0 &&
                                (step + 1) % job.checkpoint_every_steps == 0;
    const bool norm_due = prometheus_metrics != nullptr && (step + 1) % job.log_every == 0;
    // On a GPU, the host copy of the model is brought up to date when read.
    if (options.checksums || checkpoint_due || norm_due) {
      if (absl::Status s = (*session)->SyncHost(); !s.ok()) return s;
    }
    const compress::StepPlan& plan = (*session)->plan();
    const TcpCounters tcp_after = ReadTcpCounters();
    record.phase = compress::PhaseName(job.algorithm, step);
    record.up = plan.up.kind;
    record.down = plan.down.kind;
    record.step_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
    // What the step spent neither computing its gradient nor encoding on
    // this thread: waiting for replies and for encodes on the compute pool
    // that the gradient did not hide (and applying what lands meanwhile).
    record.comm_seconds =
        record.step_seconds - record.compute_seconds - record.traffic.encode_inline_seconds;
    record.wire_up = tcp_after.sent - tcp_before.sent;
    record.wire_down = tcp_after.received - tcp_before.received;
    if (options.checksums) record.checksum = replica.Checksum();
    if (prometheus_metrics != nullptr) {
      prometheus_metrics->Step(record);
      if (norm_due) prometheus_metrics->SetErrorNorm(std::sqrt((*session)->error().SquaredNorm()));
    }
    summary.payload_up += record.traffic.payload_up;
    summary.payload_down += record.traffic.payload_down;
    summary.comm_seconds += record.comm_seconds;
    if (plan.exchanges) {
      (plan.compressing ? summary.compressed_up_per_step : summary.warmup_up_per_step) = record.traffic.payload_up;
      ++summary.exchanges;
    }
    summary.final_loss = *loss;
    // The step's line before its checkpoint: a worker restarted from the
    // checkpoint has written every step before it.
    report.Record(record);
    if (checkpoint_due) {
      if (absl::Status s = (*session)->SaveCheckpoint(checkpoint); !s.ok()) {
        std::fprintf(stderr, "worker %u: checkpoint not written: %s\n", options.rank,
                     std::string(s.message()).c_str());
      }
    }
  }
  summary.wall_seconds = absl::ToDoubleSeconds(absl::Now() - train_start);
  const TcpCounters tcp_end = ReadTcpCounters();
  summary.wire_sent_bytes = tcp_end.sent - tcp_start.sent;
  summary.wire_received_bytes = tcp_end.received - tcp_start.received;
  summary.steps = job.steps - first_step;
  if (absl::Status s = (*session)->SyncHost(); !s.ok()) return s;
  summary.test_accuracy = (*workload)->TestAccuracy(replica.x());
  summary.final_checksum = replica.Checksum();
  if (metrics) metrics->flush();
  return summary;
}

}  // namespace morse::worker
