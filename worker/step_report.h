// What morse-worker reports about its steps, apart from training them:
//
// - WorkerMetrics: the worker's Prometheus series, labelled `rank`, served
//   by proto/HttpEndpoint on --metrics_listen (docs/operations.md):
//     morse_worker_steps_total,
//     morse_worker_payload_bytes_total{direction,codec},
//     morse_worker_step_seconds, morse_worker_communication_seconds
//     (histograms), morse_worker_loss, morse_worker_error_buffer_norm.
// - StepReport: one JSON line per step (--metrics) and a progress line
//   every log_every steps averaged over the interval.
//
// Trainer fills a StepRecord per step and hands it to both; tests drive them
// directly.
#ifndef MORSE_WORKER_STEP_REPORT_H_
#define MORSE_WORKER_STEP_REPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "compress/codec.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/step_exchange.h"

namespace morse::worker {

struct StepRecord {
  int64_t step = 0;
  std::string phase;  // adam, warmup, compression
  compress::CodecKind up = compress::CodecKind::kFp32,
                      down = compress::CodecKind::kFp32;
  double loss = 0;
  double step_seconds = 0, compute_seconds = 0, comm_seconds = 0;
  // diloco: an inner step's seconds where it ran alone (the first H - 1 of
  // the step's inner steps, the last sharing the host with the exchange;
  // with overlap_steps tau, the H - tau after the reply), without the merge
  // of the outer parameters; 0 when not measured.
  double inner_step_seconds = 0;
  StepTraffic traffic;
  // TCP bytes sent and received during the step (worker/wire_counter.h)
  uint64_t wire_up = 0, wire_down = 0;
  std::optional<uint64_t> checksum;  // of x, m, v (--checksums)
  // The ranks some partition's average of the step left out (membership,
  // design.md 4, "Membership"), ascending; empty when every worker was in.
  std::vector<uint32_t> absent;
};

class WorkerMetrics {
 public:
  WorkerMetrics(std::shared_ptr<prometheus::Registry> registry, uint32_t rank);
  void Step(const StepRecord& record);
  void SetErrorNorm(double norm) { error_norm_.Set(norm); }
  const std::shared_ptr<prometheus::Registry>& registry() const {
    return registry_;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::string rank_;
  prometheus::Counter& steps_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& wire_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& comm_seconds_;
  prometheus::Gauge& loss_;
  prometheus::Gauge& error_norm_;
};

class StepReport {
 public:
  struct Options {
    uint32_t rank = 0;
    int64_t steps = 0;       // the job's last step + 1
    int64_t first_step = 0;  // where this worker started (resume)
    uint32_t log_every = 10;
    double samples_per_step = 0;
    std::ostream* jsonl = nullptr;  // --metrics; null: none
    std::function<void(const std::string&)>
        log;  // progress lines; default: stdout
  };
  explicit StepReport(Options options) : options_(std::move(options)) {}

  // Writes the step's JSON line, and a progress line when the step ends an
  // interval (every log_every steps, and the last step).
  void Record(const StepRecord& record);

 private:
  const Options options_;
  double seconds_ = 0, comm_ = 0, loss_ = 0;
  uint64_t up_ = 0, down_ = 0;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_STEP_REPORT_H_
