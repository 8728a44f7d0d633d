#include "worker/step_report.h"

#include <algorithm>
#include <cstdio>
#include <ostream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace morse::worker {
namespace {

const prometheus::Histogram::BucketBoundaries& Buckets() {
  static const prometheus::Histogram::BucketBoundaries buckets = {
      0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30};
  return buckets;
}

std::string Bytes(double b) {
  if (b >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  if (b >= 1e3) return absl::StrFormat("%.1f KB", b / 1e3);
  return absl::StrFormat("%.0f B", b);
}

}  // namespace

WorkerMetrics::WorkerMetrics(std::shared_ptr<prometheus::Registry> registry,
                             uint32_t rank)
    : registry_(std::move(registry)),
      rank_(std::to_string(rank)),
      steps_(prometheus::BuildCounter()
                 .Name("morse_worker_steps_total")
                 .Help("Steps this worker completed")
                 .Register(*registry_)
                 .Add({{"rank", rank_}})),
      bytes_(prometheus::BuildCounter()
                 .Name("morse_worker_payload_bytes_total")
                 .Help("Payload bytes pushed (direction=up) and received "
                       "(down), by codec")
                 .Register(*registry_)),
      wire_(prometheus::BuildCounter()
                .Name("morse_worker_wire_bytes_total")
                .Help("TCP bytes this worker's sockets sent (direction=up, "
                      "acknowledged) and received (down), across reconnects")
                .Register(*registry_)),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("morse_worker_step_seconds")
                        .Help("Step duration")
                        .Register(*registry_)
                        .Add({{"rank", rank_}}, Buckets())),
      comm_seconds_(prometheus::BuildHistogram()
                        .Name("morse_worker_communication_seconds")
                        .Help("Time per step waiting on the shards")
                        .Register(*registry_)
                        .Add({{"rank", rank_}}, Buckets())),
      loss_(prometheus::BuildGauge()
                .Name("morse_worker_loss")
                .Help("Local loss of the last step")
                .Register(*registry_)
                .Add({{"rank", rank_}})),
      error_norm_(prometheus::BuildGauge()
                      .Name("morse_worker_error_buffer_norm")
                      .Help("L2 norm of the worker's error-feedback buffer "
                            "(every log_every steps)")
                      .Register(*registry_)
                      .Add({{"rank", rank_}})) {}

void WorkerMetrics::Step(const StepRecord& r) {
  steps_.Increment();
  bytes_
      .Add({{"rank", rank_},
            {"direction", "up"},
            {"codec", std::string(compress::CodecName(r.up))}})
      .Increment(static_cast<double>(r.traffic.payload_up));
  bytes_
      .Add({{"rank", rank_},
            {"direction", "down"},
            {"codec", std::string(compress::CodecName(r.down))}})
      .Increment(static_cast<double>(r.traffic.payload_down));
  wire_.Add({{"rank", rank_}, {"direction", "up"}})
      .Increment(static_cast<double>(r.wire_up));
  wire_.Add({{"rank", rank_}, {"direction", "down"}})
      .Increment(static_cast<double>(r.wire_down));
  step_seconds_.Observe(r.step_seconds);
  comm_seconds_.Observe(r.comm_seconds);
  loss_.Set(r.loss);
}

void StepReport::Record(const StepRecord& r) {
  if (options_.jsonl != nullptr) {
    *options_.jsonl << absl::StrFormat(
        "{\"step\":%d,\"time\":%.6f,\"phase\":\"%s\",\"loss\":%.6g,\"step_"
        "seconds\":%.6f,"
        "\"compute_seconds\":%.6f,\"encode_seconds\":%.6f,\"comm_seconds\":%."
        "6f,"
        "\"apply_seconds\":%.6f,\"bytes_up\":%u,\"bytes_down\":%u,\"wire_up\":%"
        "u,"
        "\"wire_down\":%u,\"retries\":%u",
        r.step, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()), r.phase,
        r.loss, r.step_seconds, r.compute_seconds, r.traffic.encode_seconds,
        r.comm_seconds, r.traffic.apply_seconds, r.traffic.payload_up,
        r.traffic.payload_down, r.wire_up, r.wire_down, r.traffic.retries);
    if (r.checksum.has_value())
      *options_.jsonl << absl::StrFormat(",\"checksum\":\"%016x\"",
                                         *r.checksum);
    if (r.inner_step_seconds > 0)
      *options_.jsonl << absl::StrFormat(",\"inner_step_seconds\":%.6f",
                                         r.inner_step_seconds);
    if (!r.absent.empty())
      *options_.jsonl << ",\"absent\":[" << absl::StrJoin(r.absent, ",") << "]";
    // Flushed: a worker killed later keeps its lines so far.
    *options_.jsonl << "}\n" << std::flush;
  }
  seconds_ += r.step_seconds;
  comm_ += r.comm_seconds;
  loss_ += r.loss;
  up_ += r.traffic.payload_up;
  down_ += r.traffic.payload_down;
  const int64_t done = r.step + 1;
  if (done % options_.log_every != 0 && done != options_.steps) return;
  const int64_t k = std::min<int64_t>((done - 1) % options_.log_every + 1,
                                      done - options_.first_step);
  const std::string line = absl::StrFormat(
      "worker %u: step %d/%d %-11s loss %.4f | %.0f samples/s | up %s down %s "
      "per step | comm %.0f%%",
      options_.rank, done, options_.steps, r.phase, loss_ / k,
      seconds_ > 0 ? options_.samples_per_step * k / seconds_ : 0.0,
      Bytes(double(up_) / k), Bytes(double(down_) / k),
      seconds_ > 0 ? 100.0 * comm_ / seconds_ : 0.0);
  if (options_.log) {
    options_.log(line);
  } else {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  seconds_ = comm_ = loss_ = 0;
  up_ = down_ = 0;
}

}  // namespace morse::worker
