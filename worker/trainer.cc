#include "worker/trainer.h"

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
#include "compress/kernels.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "prometheus/registry.h"
#include "proto/address.h"
#include "proto/checkpoint_file.h"
#include "proto/http_endpoint.h"
#include "worker/client.h"
#include "worker/session.h"
#include "worker/step_report.h"
#include "worker/transport/grpc/transport.h"
#include "worker/workload.h"

namespace morse::worker {

std::string TrainingSummary::ToJson() const {
  std::string json = absl::StrFormat(
      "{\"rank\":%u,\"steps\":%d,\"final_loss\":%.6g,\"payload_up_bytes\":%u,"
      "\"payload_down_bytes\":%u,\"warmup_up_bytes_per_step\":%u,"
      "\"compressed_up_bytes_per_step\":%u,\"exchanges\":%d,"
      "\"wire_sent_bytes\":%u,\"wire_received_bytes\":%u,"
      "\"wall_seconds\":%.3f,\"comm_seconds\":%.3f,\"checksum\":\"%016x\","
      "\"device\":\"%s\",\"kernels\":\"%s\"",
      rank, steps, final_loss, payload_up, payload_down, warmup_up_per_step,
      compressed_up_per_step, exchanges, wire_sent_bytes, wire_received_bytes,
      wall_seconds, comm_seconds, final_checksum, device,
      compress::ActiveKernels().name);
  if (test_accuracy.has_value())
    absl::StrAppendFormat(&json, ",\"test_accuracy\":%.4f", *test_accuracy);
  return json + "}";
}

namespace {

// Moves the session to the engine options.device names and gives the engine
// the workload's gradient: "cuda" or the GPU for "auto" when there is one
// and the job can run there (saying why not and staying on the CPU for
// "auto"), else the CPU (options.device is one of the three: Begin checks
// it before joining). Returns the line to log (empty: none).
absl::StatusOr<std::string> ChooseEngine(const TrainerOptions& options,
                                         Workload& workload, Session& session) {
  std::string line;
  if (options.device != "cpu") {
    absl::Status moved = session.MoveTo("cuda");
    if (moved.ok()) moved = session.engine().SetWorkload(workload);
    if (moved.ok()) {
      return absl::StrCat("worker ", options.rank,
                          ": x, m, v, error buffer and gradient on ",
                          session.engine().description());
    }
    if (options.device == "cuda") {
      return absl::Status(moved.code(),
                          absl::StrCat("--device cuda: ", moved.message()));
    }
    line = absl::StrCat("worker ", options.rank, ": training on the CPU (",
                        moved.message(), ")");
    if (session.engine().kind() != "cpu") {
      if (absl::Status s = session.MoveTo("cpu"); !s.ok()) return s;
    }
  }
  if (absl::Status s = session.engine().SetWorkload(workload); !s.ok())
    return s;
  return line;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const proto::JobSpec& job, const TrainerOptions& options) {
  auto transport = GrpcTransport::Create(job, options.servers, options.rank,
                                         options.security);
  if (!transport.ok()) return transport.status();
  std::unique_ptr<Trainer> trainer(new Trainer(job, options));
  trainer->count_wire_ = true;
  if (absl::Status s = trainer->Begin(*std::move(transport)); !s.ok()) return s;
  return trainer;
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const proto::JobSpec& job, const TrainerOptions& options,
    std::unique_ptr<Transport> transport) {
  std::unique_ptr<Trainer> trainer(new Trainer(job, options));
  if (absl::Status s = trainer->Begin(std::move(transport)); !s.ok()) return s;
  return trainer;
}

WireCounter::Bytes Trainer::ReadTcp() {
  return wire_ != nullptr ? wire_->Read() : WireCounter::Bytes{};
}

Trainer::Trainer(const proto::JobSpec& job, const TrainerOptions& options)
    : job_(job), options_(options) {}

Trainer::~Trainer() = default;

void Trainer::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
}

namespace {

// What Begin refuses whatever the transport.
absl::Status CheckOptions(const proto::JobSpec& job,
                          const TrainerOptions& options) {
  if (options.device != "auto" && options.device != "cpu" &&
      options.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", options.device, ": use auto, cpu or cuda"));
  }
  if (job.algorithm.diloco.warmup_steps > 0) {  // diloco's section alone
    // InnerAdam takes the same count every outer step.
    return absl::UnimplementedError(absl::StrCat(
        "diloco.warmup_steps (", job.algorithm.diloco.warmup_steps,
        ") is morse.torch.DiLoCo's for now: morse-worker's inner Adam takes "
        "sync_every / fragments steps every outer step; leave it unset"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Trainer::Check(const proto::JobSpec& job,
                            const TrainerOptions& options) {
  if (absl::Status s = CheckOptions(job, options); !s.ok()) return s;
  // Channels connect lazily: this reads the credentials and parses the
  // addresses, and reaches no shard.
  auto transport = GrpcTransport::Create(job, options.servers, options.rank,
                                         options.security);
  if (!transport.ok()) return transport.status();
  if (!options.metrics_listen.empty()) {
    auto address =
        proto::SplitHostPort(options.metrics_listen, "--metrics_listen");
    if (!address.ok()) return address.status();
  }
  return absl::OkStatus();
}

absl::Status Trainer::Begin(std::unique_ptr<Transport> transport) {
  if (absl::Status s = CheckOptions(job_, options_); !s.ok()) return s;
  auto workload = MakeWorkload(job_, options_.rank);
  if (!workload.ok()) return workload.status();
  workload_ = *std::move(workload);
  const uint64_t dim = job_.algorithm.layout.dim;
  if (workload_->dim() != dim) {
    return absl::InternalError(absl::StrCat("workload has ", workload_->dim(),
                                            " parameters, the layout ", dim));
  }
  // Metrics (--metrics_listen): morse_worker_* series (worker/step_report.h).
  if (!options_.metrics_listen.empty()) {
    prometheus_metrics_ = std::make_unique<WorkerMetrics>(
        std::make_shared<prometheus::Registry>(), options_.rank);
    auto endpoint = proto::HttpEndpoint::Start(
        options_.metrics_listen, prometheus_metrics_->registry(),
        [this] { return ready_.load(); });
    if (!endpoint.ok()) return endpoint.status();
    http_ = *std::move(endpoint);
  }
  auto session =
      Session::Connect(job_, options_.rank, std::move(transport), {},
                       options_.compute_threads, !options_.security.insecure);
  if (!session.ok()) return session.status();
  session_ = *std::move(session);
  workload_->Initialize(session_->replica().x());
  const std::string checkpoint_dir = options_.checkpoint_dir.empty()
                                         ? job_.checkpoint_dir
                                         : options_.checkpoint_dir;
  if (!checkpoint_dir.empty()) {
    if (absl::Status s = proto::MakeCheckpointDir(checkpoint_dir); !s.ok())
      return s;
    checkpoint_ =
        absl::StrCat(checkpoint_dir, "/worker-", options_.rank, ".ckpt");
  }
  bool resume = options_.resume;
  if (options_.rejoin && !resume) {
    // Ranks other than 0 take the model from the shards either way; rank 0
    // uploads it only if no one has.
    auto held = session_->ShardsHoldModel();
    if (!held.ok()) return held.status();
    resume = options_.rank != 0 || *held;
  }
  auto first = session_->Start(resume, checkpoint_);
  if (!first.ok()) return first.status();
  first_step_ = next_step_ = *first;
  const compress::AlgorithmConfig& algorithm = job_.algorithm;
  const int64_t inner_steps =
      compress::OptimizerOf(algorithm).InnerSteps(algorithm);
  if (inner_steps > 0) {  // diloco
    inner_ = std::make_unique<InnerAdam>(algorithm, dim);
    pseudo_gradient_.assign(dim, 0.0f);
    if (first_step_ > 0) {
      // Rejoining: the inner Adam state saved with this worker's checkpoint
      // of the step it starts at, or no exact continuation.
      const absl::Status loaded =
          checkpoint_.empty()
              ? absl::FailedPreconditionError("diloco: no checkpoint dir")
              : inner_->Load(InnerPath(), first_step_, options_.rank,
                             session_->layout().fingerprint(),
                             compress::AlgorithmFingerprint(algorithm));
      if (!loaded.ok()) {
        return absl::Status(
            loaded.code(),
            absl::StrCat(
                "worker ", options_.rank, " would rejoin at outer step ",
                first_step_, " without its inner Adam state (",
                loaded.message(),
                "); it continues exactly only from its own checkpoint, so "
                "restart the whole job from the shards' checkpoint instead"));
      }
    }
  }
  auto chosen = ChooseEngine(options_, *workload_, *session_);
  if (!chosen.ok()) return chosen.status();
  if (!chosen->empty()) Log(*chosen);
  ready_ = true;

  if (!options_.metrics_path.empty()) {
    metrics_ =
        std::make_unique<std::ofstream>(options_.metrics_path, std::ios::trunc);
    if (!*metrics_)
      return absl::InvalidArgumentError("cannot write metrics file " +
                                        options_.metrics_path);
  }
  summary_.rank = options_.rank;
  summary_.device = session_->engine().description();
  report_ = std::make_unique<StepReport>(StepReport::Options{
      options_.rank, job_.steps, first_step_, job_.log_every,
      static_cast<double>(workload_->samples_per_step()) *
          std::max<int64_t>(inner_steps, 1),
      metrics_.get(), options_.log});
  // Counted from here: the bytes of joining and fetching the model are not
  // the training's.
  if (count_wire_) wire_ = std::make_unique<WireCounter>();
  train_start_ = absl::Now();
  return absl::OkStatus();
}

absl::StatusOr<StepRecord> Trainer::Step() {
  if (done())
    return absl::FailedPreconditionError(
        absl::StrCat("the job's ", job_.steps, " steps are done"));
  const int64_t step = next_step_;
  Engine& engine = session_->engine();
  compress::Replica& replica = session_->replica();
  const absl::Time step_start = absl::Now();
  if (step == job_.algorithm.freeze_step &&
      compress::OptimizerOf(job_.algorithm).HasFreezeStep()) {
    // v is frozen from here on: say how much the zero-variance mask holds.
    if (absl::Status s = session_->SyncHost(); !s.ok()) return s;
    const auto v = replica.v();
    const size_t zeros =
        static_cast<size_t>(std::count(v.begin(), v.end(), 0.0f));
    Log(absl::StrFormat(
        "worker %u: v frozen at step %d; %u of %u elements have v = 0%s",
        options_.rank, step, zeros, v.size(),
        zeros == 0 ? ""
        : job_.algorithm.mask_zero_variance
            ? " and are masked (mask_zero_variance)"
            : ": with mask_zero_variance off they get +-scale/eps updates"));
  }
  StepRecord record;
  record.step = step;
  const WireCounter::Bytes tcp_before = ReadTcp();
  absl::StatusOr<double> loss;
  if (inner_ != nullptr && job_.algorithm.diloco.overlap_steps > 0) {
    // diloco with an overlap: the rest of this step's inner steps (the
    // first overlap_steps ran during the last step's exchange, except in
    // the run's first step), then this step's exchange, during which the
    // next step's first overlap_steps run; its reply is merged in the next
    // step (InnerAdam::Steps).
    const int64_t every = inner_->steps();
    const int64_t overlap = job_.algorithm.diloco.overlap_steps;
    const int64_t begin = inner_->taken() - step * every;
    auto alone = inner_->Steps(step, begin, every, *workload_, replica.x());
    if (!alone.ok()) return alone.status();
    record.compute_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
    record.inner_step_seconds =
        (record.compute_seconds - inner_->merge_seconds()) /
        static_cast<double>(every - begin);
    inner_->PseudoGradient(replica.x(), absl::MakeSpan(pseudo_gradient_));
    if (absl::Status s = session_->Begin(pseudo_gradient_); !s.ok()) return s;
    for (const compress::Partition& p : session_->layout().partitions()) {
      if (absl::Status s = session_->SendPartition(p.id); !s.ok()) return s;
    }
    double sum = *alone;
    int64_t ran = every - begin;
    if (step + 1 < job_.steps) {
      // replica.x() changes as replies land; these steps do not read it.
      const absl::Time start = absl::Now();
      auto next = inner_->Steps(step + 1, 0, overlap, *workload_, replica.x());
      if (!next.ok()) return next.status();
      record.compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
      sum += *next;
      ran += overlap;
    }
    loss = sum / static_cast<double>(ran);
    if (absl::Status s = session_->Finish(&record.traffic); !s.ok()) return s;
  } else if (inner_ != nullptr && workload_->ComputesRanges()) {
    // diloco: this worker's inner steps from the outer parameters, the last
    // a partition at a time, each partition's pseudo-gradient pushed as
    // soon as it is final, so the exchange overlaps the last inner step.
    // (A partition's x changes only with its reply, after its push.)
    const absl::Span<const float> outer = replica.x();
    auto earlier = inner_->RunAllButLast(step, *workload_, outer);
    if (!earlier.ok()) return earlier.status();
    record.compute_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
    if (inner_->steps() > 1) {
      record.inner_step_seconds =
          (record.compute_seconds - inner_->merge_seconds()) /
          static_cast<double>(inner_->steps() - 1);
    }
    if (absl::Status s = session_->Begin(pseudo_gradient_); !s.ok()) return s;
    double lanes[4] = {0, 0, 0, 0};
    for (const compress::Partition& p : session_->layout().partitions()) {
      const absl::Time start = absl::Now();
      if (absl::Status s = inner_->LastStepRange(
              step, *workload_, outer, absl::MakeSpan(pseudo_gradient_),
              p.range.begin, p.range.end, lanes);
          !s.ok())
        return s;
      record.compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
      if (absl::Status s = session_->SendPartition(p.id); !s.ok()) return s;
    }
    loss = (*earlier + GradientHook::MeanLoss(lanes, pseudo_gradient_.size())) /
           static_cast<double>(inner_->steps());
    if (absl::Status s = session_->Finish(&record.traffic); !s.ok()) return s;
  } else if (inner_ != nullptr) {
    // diloco, with a workload that computes its gradient whole.
    loss = inner_->Run(step, *workload_, replica.x(),
                       absl::MakeSpan(pseudo_gradient_));
    if (!loss.ok()) return loss.status();
    record.compute_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
    record.inner_step_seconds =
        (record.compute_seconds - inner_->merge_seconds()) /
        static_cast<double>(inner_->steps());
    if (absl::Status s = session_->Step(pseudo_gradient_, &record.traffic);
        !s.ok())
      return s;
  } else if (engine.ComputesGradientRanges()) {
    // Each partition is pushed as soon as its gradient is computed, so the
    // exchange overlaps the rest of the gradient.
    if (absl::Status s = session_->BeginFromEngine(); !s.ok()) return s;
    double lanes[4] = {0, 0, 0, 0};
    for (const compress::Partition& p : session_->layout().partitions()) {
      const absl::Time start = absl::Now();
      if (absl::Status s =
              engine.GradientRange(step, p.range.begin, p.range.end, lanes);
          !s.ok())
        return s;
      record.compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
      if (absl::Status s = session_->SendPartition(p.id); !s.ok()) return s;
    }
    loss = engine.GradientRangeLoss(lanes);
    if (absl::Status s = session_->Finish(&record.traffic); !s.ok()) return s;
  } else {
    loss = engine.Gradient(step);
    if (!loss.ok()) return loss.status();
    record.compute_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
    if (absl::Status s = session_->StepFromEngine(&record.traffic); !s.ok())
      return s;
  }
  next_step_ = step + 1;
  record.loss = *loss;
  const bool checkpoint_due = !checkpoint_.empty() &&
                              job_.checkpoint_every_steps > 0 &&
                              (step + 1) % job_.checkpoint_every_steps == 0;
  const bool norm_due =
      prometheus_metrics_ != nullptr && (step + 1) % job_.log_every == 0;
  // On a GPU, the host copy of the model is brought up to date when read.
  if (options_.checksums || checkpoint_due || norm_due) {
    if (absl::Status s = session_->SyncHost(); !s.ok()) return s;
  }
  const compress::StepPlan& plan = session_->plan();
  const WireCounter::Bytes tcp_after = ReadTcp();
  record.phase = compress::PhaseName(job_.algorithm, step);
  record.up = plan.up.kind;
  record.down = plan.down.kind;
  record.step_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
  // What the step spent neither computing its gradient nor encoding on
  // this thread: waiting for replies and for encodes on the compute pool
  // that the gradient did not hide (and applying what lands meanwhile).
  record.comm_seconds = record.step_seconds - record.compute_seconds -
                        record.traffic.encode_inline_seconds;
  record.wire_up = tcp_after.sent - tcp_before.sent;
  record.wire_down = tcp_after.received - tcp_before.received;
  if (options_.checksums) record.checksum = replica.Checksum();
  record.absent = session_->left_out();
  if (prometheus_metrics_ != nullptr) {
    prometheus_metrics_->Step(record);
    if (norm_due)
      prometheus_metrics_->SetErrorNorm(
          std::sqrt(session_->error().SquaredNorm()));
  }
  summary_.payload_up += record.traffic.payload_up;
  summary_.payload_down += record.traffic.payload_down;
  summary_.comm_seconds += record.comm_seconds;
  if (plan.exchanges) {
    (plan.compressing ? summary_.compressed_up_per_step
                      : summary_.warmup_up_per_step) =
        record.traffic.payload_up;
    ++summary_.exchanges;
  }
  summary_.final_loss = *loss;
  // The step's line before its checkpoint: a worker restarted from the
  // checkpoint has written every step before it.
  report_->Record(record);
  if (checkpoint_due) {
    absl::Status s = session_->SaveCheckpoint(checkpoint_);
    if (s.ok() && inner_ != nullptr) {
      // diloco: the inner Adam state of the same step, beside it.
      s = inner_->Save(InnerPath(), next_step_, options_.rank,
                       session_->layout().fingerprint(),
                       compress::AlgorithmFingerprint(job_.algorithm));
    }
    if (!s.ok()) {
      std::fprintf(stderr, "worker %u: checkpoint not written: %s\n",
                   options_.rank, std::string(s.message()).c_str());
    }
  }
  return record;
}

absl::StatusOr<TrainingSummary> Trainer::Summary() {
  TrainingSummary summary = summary_;
  summary.wall_seconds = absl::ToDoubleSeconds(absl::Now() - train_start_);
  const WireCounter::Bytes tcp_end = ReadTcp();
  summary.wire_sent_bytes = tcp_end.sent;
  summary.wire_received_bytes = tcp_end.received;
  summary.steps = next_step_ - first_step_;
  if (absl::Status s = session_->SyncHost(); !s.ok()) return s;
  summary.test_accuracy = workload_->TestAccuracy(session_->replica().x());
  summary.final_checksum = session_->replica().Checksum();
  if (metrics_) metrics_->flush();
  return summary;
}

absl::StatusOr<TrainingSummary> Trainer::Run() {
  while (!done()) {
    if (auto record = Step(); !record.ok()) return record.status();
  }
  return Summary();
}

absl::StatusOr<TrainingSummary> Train(const proto::JobSpec& job,
                                      const TrainerOptions& options) {
  auto trainer = Trainer::Create(job, options);
  if (!trainer.ok()) return trainer.status();
  return (*trainer)->Run();
}

}  // namespace morse::worker
