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
#include "compress/algorithm.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/update_rules.h"

namespace morse::compress {

class Simulator {
 public:
  // Starts at step 0 from parameters x0 (size D), m = v = 0, zero errors.
  static absl::StatusOr<Simulator> Create(const AlgorithmConfig& config,
                                          absl::Span<const float> x0);

  // Runs one step. gradients[i] is worker i's gradient (size D).
  // INVALID_ARGUMENT on wrong sizes or a non-finite encode; state is then
  // undefined for an encode failure and unchanged for a size error.
  // `hypers`: this step's learning rates and weight decays set by the
  // workers (as pushes carry them), instead of the schedule: one for the
  // model, or one per segment of the layout (parameter groups; HyperOf).
  // `absent`: the workers
  // each partition's average leaves out (their messages are formed, and
  // their error buffers move, as a late worker's do); INVALID_ARGUMENT,
  // state unchanged, for a rank out of range or a partition with none in.
  absl::Status Step(absl::Span<const absl::Span<const float>> gradients,
                    absl::Span<const StepHyper> hypers = {},
                    const Absent& absent = {});

  // Weights changed between steps (design.md 4, "Weights changed after a
  // step"): every replica's x becomes `x`, the rest of the state kept.
  // INVALID_ARGUMENT, nothing changed, for a wrong size or non-finite
  // values; FAILED_PRECONDITION inside a zero_one_adam local interval.
  absl::Status ReplaceX(absl::Span<const float> x);
  // Inside a zero_one_adam local interval, worker `rank`'s own x changed
  // between steps (design.md 2.7, "Weights changed inside an interval"):
  // its local steps go on from `x`; the sync starts from the anchor as
  // always. FAILED_PRECONDITION outside an interval, INVALID_ARGUMENT,
  // nothing changed, for a wrong rank or size or non-finite values.
  absl::Status ReplaceWorkerX(uint32_t rank, absl::Span<const float> x);

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
  // An optimizer with a layer rule (compress/layers.h): its per-element
  // array (onebit_lamb's fresh variance) and its layer state
  // (FlattenLambLayers' order).
  absl::Span<const float> v_fresh() const { return v_fresh_; }
  absl::Span<const float> layer_state() const { return layer_state_; }
  const ErrorFeedback& server_error(uint32_t shard) const {
    return server_errors_[shard];
  }

 private:
  Simulator(const AlgorithmConfig& config, Layout layout,
            absl::Span<const float> x0);

  // One partition's round trip from the workers' gradients, through the
  // sender's rule (compress/replica.h) on both sides; returns the decoded
  // reply (what every worker receives) in `reply`. `hyper`: the
  // partition's, as its pushes carry it.
  absl::Status RoundTrip(const Partition& p,
                         absl::Span<const absl::Span<const float>> gradients,
                         absl::Span<const uint32_t> absent,
                         const StepHyper* hyper, std::vector<float>& reply);

  AlgorithmConfig config_;
  Layout layout_;
  int64_t step_ = 0;
  std::vector<float> x_, m_, v_;
  std::vector<ErrorFeedback> worker_errors_;
  std::vector<ErrorFeedback> server_errors_;
  // zero_one_adam's local phase: each worker's x, m and accumulated update
  // u since the last sync (x_ is the anchor), the interval's learning-rate
  // sum of each segment, and whether the workers have left x_, m_ (a local step
  // since the last exchange).
  struct Local {
    std::vector<float> x, m, u;
  };
  std::vector<Local> locals_;
  std::vector<float> lr_sums_;
  bool diverged_ = false;
  std::vector<float> v_fresh_;
  std::vector<float> layer_state_;
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_SIMULATOR_H_
