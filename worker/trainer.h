// Trainer: one worker's whole job — workload, replica of x/m/v, worker error
// buffer, the client — and the step loop of DESIGN 2.1/2.2, with progress
// lines, a JSON-lines metrics file and a final summary.
#ifndef MORSE_WORKER_TRAINER_H_
#define MORSE_WORKER_TRAINER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job_config.h"
#include "proto/security.h"

namespace morse::worker {

struct TrainerOptions {
  uint32_t rank = 0;
  std::vector<std::string> servers;  // shard order
  proto::SecurityOptions security;   // credentials for the servers
  std::string metrics_path;          // JSON lines, one per step; empty: none
  bool checksums = false;            // add x/m/v checksums to each metrics line
  // Where worker-<rank>.ckpt (this worker's error buffer) is written every
  // checkpoint_every_steps steps; empty: the config's checkpoint.dir.
  std::string checkpoint_dir;
  // Join a running or restarted job (Session::Start): from this worker's
  // checkpoint if it holds a step the shards have reached, replaying the
  // steps since; else x, m, v from the shards at their step, the error
  // buffer from a checkpoint of that step if there is one.
  bool resume = false;
  // Resume if the shards already hold the model (a restarted worker), start
  // fresh otherwise; for supervisors that restart workers (systemd, Jobs).
  bool rejoin = false;
  // Where x, m, v, the error buffer and the gradient live: "auto" (the GPU
  // when there is one and the job can run there, else the CPU, saying why),
  // "cpu", or "cuda" (the GPU or an error).
  std::string device = "auto";
  // host:port for Prometheus /metrics, /healthz and /readyz (ready once the
  // worker has joined every shard and started); empty: none.
  std::string metrics_listen;
  // The session's compute pool (Session::Connect; 0: none).
  int compute_threads = 0;
};

struct TrainingSummary {
  uint32_t rank = 0;
  int64_t steps = 0;
  double final_loss = 0;
  std::optional<double> test_accuracy;
  uint64_t payload_up = 0, payload_down = 0;  // totals
  uint64_t warmup_up_per_step = 0, compressed_up_per_step = 0;
  // Steps that exchanged with the shards (all but zero_one_adam's local steps).
  int64_t exchanges = 0;
  // TCP bytes over this process's sockets during training (TCP_INFO).
  uint64_t wire_sent_bytes = 0, wire_received_bytes = 0;
  double wall_seconds = 0;
  double comm_seconds = 0;
  uint64_t final_checksum = 0;
  std::string device = "cpu";  // or the GPU's description

  std::string ToJson() const;
};

absl::StatusOr<TrainingSummary> Train(const proto::JobSpec& job, const TrainerOptions& options);

}  // namespace morse::worker

#endif  // MORSE_WORKER_TRAINER_H_
