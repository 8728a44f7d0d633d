// ServerMetrics: a shard's Prometheus metrics, kept with prometheus-cpp and
// served by proto/HttpEndpoint on --metrics_listen (docs/operations.md).
//
//   morse_server_pushes_total{code}            pushes answered, by status code
//   morse_server_received_bytes_total{codec}   push payload bytes received
//   morse_server_sent_bytes_total{codec}       reply payload bytes sent
//   morse_server_steps_total                   steps completed by the shard
//   morse_server_step_seconds                  time between step completions
//   morse_server_workers_joined                workers that joined
//   morse_server_error_buffer_norm             L2 norm of the shard's error
//                                              buffer
//   morse_server_unauthenticated_calls_total   calls refused for a missing or
//                                              wrong token
//   morse_server_members                       workers in every partition's
//                                              membership (design.md 4,
//                                              "Membership")
//   morse_server_workers_dropped_total         times a step completed without
//                                              a worker (min_workers)
// Thread-safe (prometheus-cpp metrics are).
#ifndef MORSE_SERVER_METRICS_H_
#define MORSE_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace morse::server {

class ServerMetrics {
 public:
  explicit ServerMetrics(std::shared_ptr<prometheus::Registry> registry,
                         uint32_t shard);

  void Push(absl::StatusCode code, compress::CodecKind codec, size_t bytes_in,
            size_t bytes_out);
  void StepCompleted(double seconds);
  void SetWorkersJoined(uint32_t n) { workers_joined_.Set(n); }
  void SetErrorNorm(double norm) { error_norm_.Set(norm); }
  void Unauthenticated() { unauthenticated_.Increment(); }
  // The membership after ShardCore::ExpireWaiting: members now, and the
  // workers dropped so far (a total; the counter follows it).
  void SetMembership(uint32_t members, uint64_t dropped_total);
  const std::shared_ptr<prometheus::Registry>& registry() const {
    return registry_;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::string shard_;
  prometheus::Family<prometheus::Counter>& pushes_;
  prometheus::Family<prometheus::Counter>& received_;
  prometheus::Family<prometheus::Counter>& sent_;
  prometheus::Counter& steps_;
  prometheus::Histogram& step_seconds_;
  prometheus::Gauge& workers_joined_;
  prometheus::Gauge& error_norm_;
  prometheus::Counter& unauthenticated_;
  prometheus::Gauge& members_;
  prometheus::Counter& dropped_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_METRICS_H_
