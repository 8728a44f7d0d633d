// Trainer: one worker's whole job — workload, replica of x/m/v, worker error
// buffer, the client — and the step loop of DESIGN 2.1/2.2, with progress
// lines, a JSON-lines metrics file, checkpoints and a final summary.
#ifndef MORSE_WORKER_TRAINER_H_
#define MORSE_WORKER_TRAINER_H_

#include <atomic>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/http_endpoint.h"
#include "proto/job_config.h"
#include "proto/security.h"
#include "worker/inner_adam.h"
#include "worker/session.h"
#include "worker/step_report.h"
#include "worker/transport/transport.h"
#include "worker/wire_counter.h"
#include "worker/workload.h"

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
  // Progress lines (the step report's, the device's, the freeze's);
  // default: stdout.
  std::function<void(const std::string&)> log;
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

  // The final JSON line; besides the fields above, "kernels" names the CPU
  // kernel table in use (scalar, avx2 or avx512; MORSE_SIMD narrows the
  // choice), whose bits are the same on every table.
  std::string ToJson() const;
};

// One worker's job from join to summary, a step at a time, so that tests
// can drive it (over tests/inproc's cluster) and stop it between steps as a
// kill would; morse-worker's main() only parses flags and calls Train().
//
//   auto trainer = Trainer::Create(job, options);   // joined, started
//   while (!(*trainer)->done()) (*trainer)->Step();  // one step each
//   auto summary = (*trainer)->Summary();
//
// Not thread-safe: one thread drives it.
class Trainer {
 public:
  // Everything before the first step: the workload, the metrics endpoint,
  // the session to options.servers over gRPC, the start (fresh, --resume or
  // --rejoin from this worker's checkpoint) and the engine (--device).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const proto::JobSpec& job, const TrainerOptions& options);
  // The same over any transport (options.servers and security unused).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const proto::JobSpec& job, const TrainerOptions& options,
      std::unique_ptr<Transport> transport);
  // What Create would refuse before it reaches a shard or reads data: the
  // options (--device), a config section morse-worker cannot run, the
  // servers' addresses and credentials, the metrics address. For
  // --check_config; Create checks the same.
  static absl::Status Check(const proto::JobSpec& job,
                            const TrainerOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The step this worker started at (0, or where a resume took it) and the
  // one Step() runs next.
  int64_t first_step() const { return first_step_; }
  int64_t next_step() const { return next_step_; }
  bool done() const { return next_step_ >= job_.steps; }

  // Runs step next_step(): the gradient (a partition at a time, each pushed
  // as soon as it is computed, where the workload allows), the exchange,
  // the metrics and progress lines, and this worker's checkpoint when due
  // (a checkpoint that cannot be written is reported, not fatal). After an
  // error the trainer is unusable (the session must rejoin: a new Trainer
  // with rejoin).
  absl::StatusOr<StepRecord> Step();

  // After the last step: totals, test accuracy and the final checksum.
  absl::StatusOr<TrainingSummary> Summary();

  // Step() until done(), then Summary().
  absl::StatusOr<TrainingSummary> Run();

  Session& session() { return *session_; }

 private:
  Trainer(const proto::JobSpec& job, const TrainerOptions& options);
  absl::Status Begin(std::unique_ptr<Transport> transport);
  // This process's TCP bytes since the run began, across reconnects (over
  // gRPC only: another transport has no sockets, and the process's other
  // threads open and close files).
  WireCounter::Bytes ReadTcp();
  void Log(const std::string& line) const;
  // diloco: where the inner Adam state is saved beside the checkpoint.
  std::string InnerPath() const { return checkpoint_ + ".inner"; }

  const proto::JobSpec job_;
  const TrainerOptions options_;
  std::unique_ptr<Workload> workload_;
  std::unique_ptr<WorkerMetrics> prometheus_metrics_;
  std::atomic<bool> ready_{false};  // /readyz; outlives http_
  std::unique_ptr<proto::HttpEndpoint> http_;
  std::unique_ptr<Session> session_;
  // diloco: the inner steps of each outer step, and their pseudo-gradient.
  std::unique_ptr<InnerAdam> inner_;
  std::vector<float> pseudo_gradient_;
  std::string checkpoint_;                  // this worker's; empty: none
  std::unique_ptr<std::ofstream> metrics_;  // --metrics
  std::unique_ptr<StepReport> report_;
  TrainingSummary summary_;
  bool count_wire_ = false;            // over gRPC
  std::unique_ptr<WireCounter> wire_;  // from the first step; null: none
  absl::Time train_start_;
  int64_t first_step_ = 0, next_step_ = 0;
};

// Trainer::Create(job, options), then Run().
absl::StatusOr<TrainingSummary> Train(const proto::JobSpec& job,
                                      const TrainerOptions& options);

}  // namespace morse::worker

#endif  // MORSE_WORKER_TRAINER_H_
