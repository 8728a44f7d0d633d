// JobSpec: the whole job's configuration as plain C++, loaded from a
// JobConfig (proto/morse.proto) in text format or JSON. Server and worker
// cores take a JobSpec and never see generated types (DESIGN 5).
//
// LoadJobConfig fills every default, validates every field and returns
// INVALID_ARGUMENT naming the field and the value when something is wrong.
#ifndef MORSE_PROTO_JOB_CONFIG_H_
#define MORSE_PROTO_JOB_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/simulator.h"

namespace morse::proto {

enum class WorkloadKind : uint8_t { kSynthetic, kMlp, kExternal };

struct SyntheticSpec {
  uint64_t dim = 0;
  float noise = 0.1f;
  uint32_t dead_every =
      0;  // elements j % dead_every == 0 get a zero gradient (0: none)
};

struct MlpSpec {
  std::string train_path;
  std::string test_path;
  std::string format = "csv";  // csv (label first) or libsvm
  std::vector<uint32_t> hidden = {64};
  uint32_t batch_size = 32;
  uint32_t features = 0;  // required: servers size the model without data
  uint32_t classes = 0;   // required
};

struct ExternalSpec {
  uint64_t dim = 0;  // 0: not known yet (a server waiting for workers)
  uint64_t shapes_fingerprint = 0;
  std::string shapes;
  // Layouts taken anew during the job (ExternalModel.generation).
  uint32_t generation = 0;
};

// Parameters of an MLP: sum over layers of in*out weights + out biases.
uint64_t MlpParameterCount(const MlpSpec& mlp);
// Its parameter tensors' sizes in order (each layer's weights, then its
// biases): onebit_lamb's layers.
std::vector<uint64_t> MlpLayerSizes(const MlpSpec& mlp);

struct JobSpec {
  std::string name;
  // Workers, layout, optimizer, schedule, codecs, feedback, seed: everything
  // DESIGN section 2 needs, in the form the simulator takes.
  compress::AlgorithmConfig algorithm;
  int64_t steps = 0;
  WorkloadKind workload = WorkloadKind::kSynthetic;
  SyntheticSpec synthetic;
  MlpSpec mlp;
  ExternalSpec external;
  // The JobConfig this spec came from, serialized, for Join.
  std::string config_proto;
  double connect_timeout_seconds = 60;
  double step_timeout_seconds = 60;
  double rpc_timeout_seconds = 120;
  double recovery_timeout_seconds = 300;
  // An elastic job's grace after min_workers pushes (timeouts.
  // straggler_seconds; design.md 4, "Stragglers"); 0: none.
  double straggler_timeout_seconds = 0;
  uint32_t channels_per_shard = 2;
  // Pushes a worker uploads to one shard at once (JobConfig.
  // uploads_per_shard); 0: every push in the window at once.
  uint32_t uploads_per_shard = 1;
  // Partitions a worker keeps in flight (JobConfig.window); 0 where the
  // config leaves it out: the engine's (Engine::DefaultWindow).
  uint32_t window = 0;
  uint32_t log_every = 10;
  uint32_t checkpoint_every_steps = 0;
  std::string checkpoint_dir;
  uint32_t replay_steps = 0;  // pushes a worker retains (steps)
  // The fewest workers a step completes with (JobConfig.min_workers;
  // design.md 4, "Membership"); workers() when the config leaves it out.
  uint32_t min_workers = 1;
  // Local ranks per worker (JobConfig.local_ranks; a node, NodeWorkload).
  uint32_t local_ranks = 1;

  uint32_t workers() const { return algorithm.workers; }
  // False for an external model whose size the workers have not sent yet.
  bool sized() const { return algorithm.layout.dim > 0; }
  uint32_t shards() const { return algorithm.layout.shards; }
  // Missing workers leave a step's membership instead of failing it.
  bool elastic() const { return min_workers < workers(); }
};

enum class ConfigFormat : uint8_t { kText, kJson };

// Parses and validates. Relative data paths are kept as given.
absl::StatusOr<JobSpec> ParseJobConfig(absl::string_view text,
                                       ConfigFormat format);

// A base config (text format) with `overrides` (text format) merged over it:
// fields set in the overrides replace the base's (the PyTorch binding sets
// the optimizer's arguments and the model over the launcher's base).
absl::StatusOr<JobSpec> ParseJobConfigWithOverrides(
    absl::string_view base, absl::string_view overrides);

// The same from serialized JobConfig bytes (what Join carries).
absl::StatusOr<JobSpec> ParseJobConfigProto(absl::string_view serialized);

// Reads a file: JSON if the name ends in .json or the text starts with '{',
// text format otherwise. Errors name the file: NOT_FOUND (or
// PERMISSION_DENIED) with the system's reason where it cannot be opened,
// INVALID_ARGUMENT for a folder and for a file with nothing but
// whitespace, which would otherwise read as a config of defaults.
absl::StatusOr<JobSpec> LoadJobConfig(const std::string& path);

// Trailing metadata of refused pushes (DESIGN 4, shard recovery): an
// ABORTED push ahead of its partition carries the step the partition
// accepts (decimal); an UNAVAILABLE one from a shard that has no model yet
// (an external job's shard that restarted) asks the worker to Join again.
inline constexpr char kNextStepKey[] = "morse-next-step";
inline constexpr char kNeedsJoinKey[] = "morse-needs-join";
// DEADLINE_EXCEEDED from a shard that gave up on a step (recovery timeout),
// as opposed to a push's own RPC deadline, which the worker retries.
inline constexpr char kStepExpiredKey[] = "morse-step-expired";
// The most bytes of module buffers a push may carry (PushRequest.buffers).
inline constexpr size_t kMaxBufferBytes = size_t{64} << 20;

// The largest job a config may describe, whatever the host: ranks are 32-bit
// on the wire and a shard keeps a push slot per worker and partition.
inline constexpr uint32_t kMaxWorkers = 65536;
inline constexpr uint32_t kMaxShards = 65536;
// onebit_lamb's layers: at most this many (every push carries 3 doubles
// each, the last step's commit).
inline constexpr uint64_t kMaxLayers = 65536;
// Timeouts above a week are refused (gRPC deadlines are absolute times).
inline constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600.0;

// Physical memory of this host in bytes (sysconf), or 0 if unknown.
uint64_t HostMemoryBytes();
// RESOURCE_EXHAUSTED naming `what` when `bytes` exceed `limit` (the host's
// memory by default; 0 means unknown, and then nothing is refused).
absl::Status CheckFitsInMemory(uint64_t bytes, absl::string_view what,
                               uint64_t limit = HostMemoryBytes());
// What a worker holds for the whole model (x, m, v, its error buffer and a
// gradient; DESIGN 2, and the pushes it retains for a restarted shard:
// replay_steps of them) and a shard for its range (x, m, v, the server error
// buffer, and the replies it keeps for a restarted worker: replay_steps of
// them), in bytes, before anything is allocated. Retained payloads are
// counted over the job's first replay_steps steps (the widest: fp32 warmup
// comes first).
uint64_t WorkerStateBytes(const JobSpec& job);
uint64_t ShardStateBytes(const JobSpec& job, uint64_t shard_elems);

}  // namespace morse::proto

#endif  // MORSE_PROTO_JOB_CONFIG_H_
