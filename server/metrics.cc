#include "server/metrics.h"

#include "prometheus/family.h"

namespace morse::server {

ServerMetrics::ServerMetrics(std::shared_ptr<prometheus::Registry> registry,
                             uint32_t shard)
    : registry_(std::move(registry)),
      shard_(std::to_string(shard)),
      pushes_(prometheus::BuildCounter()
                  .Name("morse_server_pushes_total")
                  .Help("Pushes answered, by gRPC status code")
                  .Register(*registry_)),
      received_(prometheus::BuildCounter()
                    .Name("morse_server_received_bytes_total")
                    .Help("Push payload bytes received, by codec")
                    .Register(*registry_)),
      sent_(prometheus::BuildCounter()
                .Name("morse_server_sent_bytes_total")
                .Help("Reply payload bytes sent, by codec")
                .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("morse_server_steps_total")
                 .Help("Steps completed by every partition of the shard")
                 .Register(*registry_)
                 .Add({{"shard", shard_}})),
      step_seconds_(
          prometheus::BuildHistogram()
              .Name("morse_server_step_seconds")
              .Help("Time between consecutive step completions")
              .Register(*registry_)
              .Add({{"shard", shard_}},
                   prometheus::Histogram::BucketBoundaries{
                       0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30})),
      workers_joined_(prometheus::BuildGauge()
                          .Name("morse_server_workers_joined")
                          .Help("Workers that have joined the shard")
                          .Register(*registry_)
                          .Add({{"shard", shard_}})),
      error_norm_(prometheus::BuildGauge()
                      .Name("morse_server_error_buffer_norm")
                      .Help("L2 norm of the shard's error-feedback buffer")
                      .Register(*registry_)
                      .Add({{"shard", shard_}})),
      unauthenticated_(
          prometheus::BuildCounter()
              .Name("morse_server_unauthenticated_calls_total")
              .Help(
                  "Calls refused with UNAUTHENTICATED (missing or wrong token)")
              .Register(*registry_)
              .Add({{"shard", shard_}})),
      members_(prometheus::BuildGauge()
                   .Name("morse_server_members")
                   .Help("Workers in every partition's membership (a step "
                         "completes without the others; min_workers)")
                   .Register(*registry_)
                   .Add({{"shard", shard_}})),
      dropped_(prometheus::BuildCounter()
                   .Name("morse_server_workers_dropped_total")
                   .Help("Times a partition's step completed without a "
                         "worker (min_workers)")
                   .Register(*registry_)
                   .Add({{"shard", shard_}})) {}

void ServerMetrics::Push(absl::StatusCode code, compress::CodecKind codec,
                         size_t bytes_in, size_t bytes_out) {
  pushes_.Add({{"shard", shard_}, {"code", absl::StatusCodeToString(code)}})
      .Increment();
  const std::string name(compress::CodecName(codec));
  received_.Add({{"shard", shard_}, {"codec", name}})
      .Increment(static_cast<double>(bytes_in));
  if (bytes_out > 0) {
    sent_.Add({{"shard", shard_}, {"codec", name}})
        .Increment(static_cast<double>(bytes_out));
  }
}

void ServerMetrics::SetMembership(uint32_t members, uint64_t dropped_total) {
  members_.Set(members);
  const double more = static_cast<double>(dropped_total) - dropped_.Value();
  if (more > 0) dropped_.Increment(more);
}

void ServerMetrics::StepCompleted(double seconds) {
  steps_.Increment();
  step_seconds_.Observe(seconds);
}

}  // namespace morse::server
