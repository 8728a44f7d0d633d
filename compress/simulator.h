// Simulator: DESIGN section 2 in one process, with no threads and no RPC.
//
// N workers and S server shards, fed one gradient per worker per step,
// produce the model (x, m, v, identical on every worker by construction) and
// every error buffer after each step. It is the oracle the distributed system
// is tested against, so it is written to be obviously right rather than fast:
// it walks the partitions of the layout in order and does, for each, exactly
// what the worker and the shard do.
//
// Not thread-safe; use one per thread.
#ifndef MORSE_COMPRESS_SIMULATOR_H_
#define MORSE_COMPRESS_SIMULATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/update_rules.h"

namespace morse::compress {

// A step's learning rate and weight decay set by the workers (PyTorch's
// param_groups, carried in every push) instead of the job's schedule and
// adam.weight_decay. Both finite and not negative (ValidateStepHyper).
struct StepHyper {
  float lr = 0;
  float weight_decay = 0;
};
absl::Status ValidateStepHyper(const StepHyper& hyper);

enum class OptimizerKind : uint8_t {
  kOneBitAdam,
  kAdam,
  kZeroOneAdam,
  kOneBitLamb
};

// zero_one_adam's schedule (design.md 2.7; DeepSpeed's ZeroOneAdam names and
// defaults). Steps are counted from 1 here, as in the paper: step t of the
// job is s = t + 1.
struct ZeroOneSpec {
  // F: v may be updated at steps s <= F only; from s = F + 1 on the local
  // phase (local steps and syncs). At least 1.
  int64_t var_freeze_step = 100000;
  // kappa: v is updated at kappa steps with interval 1, then kappa with
  // interval 2, 4, ... At least 1.
  int64_t var_update_scaler = 16;
  // The local phase's interval between syncs doubles every this many steps
  // (S, at least 1) up to local_step_clipper (H, at least 1).
  int64_t local_step_scaler = 32678;
  int64_t local_step_clipper = 16;
};

// onebit_lamb's coefficients (design.md 2.8; DeepSpeed's OnebitLamb names
// and defaults). Warmup: a layer's coefficient is ||x|| / ||u|| clamped to
// [min_coeff, max_coeff], and coeff_freeze its moving average with
// coeff_beta. Compression: coeff_freeze times a factor from the fresh
// variance, clamped to [factor_min, factor_max] and to within
// factor_threshold of the last step's.
struct LambSpec {
  float max_coeff = 10.0f;
  float min_coeff = 0.01f;
  float coeff_beta = 0.9f;
  float factor_max = 4.0f;
  float factor_min = 0.5f;
  float factor_threshold = 0.1f;
};

// A onebit_lamb layer's state, the same on every replica (compress/lamb.h).
struct LambLayerState {
  float coeff_freeze = 0.0f;  // the warmup coefficients' moving average
  float last_factor = 1.0f;   // the compression phase's last factor
};

struct SimulatorConfig {
  OptimizerKind optimizer = OptimizerKind::kOneBitAdam;
  uint32_t workers = 1;  // N
  LayoutSpec layout;
  AdamHyper adam;
  LrSchedule lr;
  // onebit_adam: steps t < freeze_step are warmup (full-precision Adam);
  // from freeze_step on, v is frozen. At least 1.
  int64_t freeze_step = 1;
  // onebit_adam: the codec of both directions in warmup (fp32, fp16, bf16;
  // no error feedback).
  CodecSpec warmup_codec{CodecKind::kFp32};
  // The compression-phase codecs (onebit_adam) or the every-step codecs
  // (adam): up = worker -> server, down = server -> worker.
  CodecSpec up_codec{CodecKind::kSign1};
  CodecSpec down_codec{CodecKind::kSign1};
  FeedbackSpec worker_feedback;  // ef by default
  FeedbackSpec server_feedback;
  // Both optimizers (DESIGN 2.1, 2.2): m̂ = m/(1-b1^t'), v̂ = v/(1-b2^t'),
  // and for onebit_adam v̂ = v/(1-b2^T_w) from the freeze on. Off: m̂ = m,
  // v̂ = v (DeepSpeed's OnebitAdam).
  bool bias_correction = true;
  // onebit_adam (DESIGN 2.1): from the freeze on, elements whose frozen v
  // is exactly 0 send, carry and apply +0.
  bool mask_zero_variance = true;
  // onebit_adam (DESIGN 2.1): from the freeze on, |m̂/(sqrt(v̂)+eps)| is at
  // most OneBitUpdateBound(adam), Adam's own largest step.
  bool bound_update = true;
  // Clipping by the gradient's global L2 norm (torch's clip_grad_norm_),
  // 0: off. Steps that average gradients (adam, onebit_adam's warmup) scale
  // the averaged gradient by ClipScale of its norm over the whole model;
  // onebit_adam's compression phase, which has no averaged gradient, scales
  // each worker's own gradient by ClipScale of its own norm before its local
  // momentum (as DeepSpeed does). ClipsAverage/ClipsLocally say which.
  float clip_grad_norm = 0;
  ZeroOneSpec zero_one;  // zero_one_adam only
  LambSpec lamb;         // onebit_lamb only
  // The model's layers (parameter tensors) as element counts in order,
  // summing to layout.dim; empty: one layer of the whole model. Only
  // onebit_lamb reads them (its coefficients are per layer).
  std::vector<uint64_t> layers;
  uint64_t seed = 0;  // stochastic rounding
};

// OK or INVALID_ARGUMENT naming the field; shared with the job config loader.
absl::Status ValidateSimulatorConfig(const SimulatorConfig& config);

// The stochastic-rounding key of a sender: workers are ranks 0..N-1, shard s
// sends as rank N + s.
RoundingKey SenderKey(const SimulatorConfig& config, int64_t step,
                      uint32_t sender_rank, uint64_t first_index);

class Simulator {
 public:
  // Starts at step 0 from parameters x0 (size D), m = v = 0, zero errors.
  static absl::StatusOr<Simulator> Create(const SimulatorConfig& config,
                                          absl::Span<const float> x0);

  // Runs one step. gradients[i] is worker i's gradient (size D).
  // INVALID_ARGUMENT on wrong sizes or a non-finite encode; state is then
  // undefined for an encode failure and unchanged for a size error.
  // `hyper`: this step's learning rate and weight decay set by the workers
  // (as pushes carry them), instead of the schedule.
  absl::Status Step(absl::Span<const absl::Span<const float>> gradients,
                    const StepHyper* hyper = nullptr);

  int64_t step() const { return step_; }  // steps completed
  bool compressing() const;               // is the next step compressed?
  const Layout& layout() const { return layout_; }
  // The state every replica agrees on: after the last exchange, what the
  // shards' mirrors hold.
  absl::Span<const float> x() const { return x_; }
  absl::Span<const float> m() const { return m_; }
  absl::Span<const float> v() const { return v_; }
  // Worker `rank`'s own x and m: x() and m() except after zero_one_adam's
  // local steps (design.md 2.7), where each worker has moved on its own.
  uint32_t worker_count() const { return config_.workers; }
  absl::Span<const float> worker_x(uint32_t rank) const;
  absl::Span<const float> worker_m(uint32_t rank) const;
  const ErrorFeedback& worker_error(uint32_t rank) const {
    return worker_errors_[rank];
  }
  // onebit_lamb (compress/lamb.h): the fresh variance and the layers' state.
  absl::Span<const float> v_fresh() const { return v_fresh_; }
  absl::Span<const LambLayerState> lamb_layers() const { return lamb_layers_; }
  const ErrorFeedback& server_error(uint32_t shard) const {
    return server_errors_[shard];
  }

 private:
  Simulator(const SimulatorConfig& config, Layout layout,
            absl::Span<const float> x0);

  // One partition's round trip from the workers' gradients, through the
  // sender's rule (compress/replica.h) on both sides; returns the decoded
  // reply (what every worker receives) in `reply`.
  absl::Status RoundTrip(const Partition& p,
                         absl::Span<const absl::Span<const float>> gradients,
                         std::vector<float>& reply);

  SimulatorConfig config_;
  Layout layout_;
  int64_t step_ = 0;
  std::vector<float> x_, m_, v_;
  std::vector<ErrorFeedback> worker_errors_;
  std::vector<ErrorFeedback> server_errors_;
  // zero_one_adam's local phase: each worker's x, m and accumulated update
  // u since the last sync (x_ is the anchor), the interval's learning-rate
  // sum, and whether the workers have left x_, m_ (a local step since the
  // last exchange).
  struct Local {
    std::vector<float> x, m, u;
  };
  std::vector<Local> locals_;
  float lr_sum_ = 0;
  bool diverged_ = false;
  std::vector<float> v_fresh_;
  std::vector<LambLayerState> lamb_layers_;
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_SIMULATOR_H_
