// InnerAdam: diloco's inner optimizer for morse-worker's built-in workloads
// (design.md 2.11). Each outer step, the worker trains its own copy of the
// model from the outer parameters with sync_every steps of Adam (the job's
// adam settings and lr schedule, counted in inner steps), then hands the
// session its pseudo-gradient x_outer - x_local. m and v are this worker's
// own and carry over from one outer step to the next, as DiLoCo's inner
// optimizer state does. Save/Load keep them beside the worker's checkpoint,
// so that a restarted worker continues the run exactly.
//
// Streaming DiLoCo (diloco.fragments F > 1): an outer step is sync_every / F
// inner steps, and only the partitions the previous step synced start again
// from the outer parameters; the others keep this worker's progress, which
// Save/Load then keep too.
//
// Overlap (diloco.overlap_steps tau > 0): the worker takes the first tau
// inner steps of outer step t + 1 while step t's exchange runs, and merges
// step t's outer parameters into its own only then (compress::MergeOuter,
// by diloco.mixing), so Save/Load keep its parameters and the count of
// inner steps taken as well.
#ifndef MORSE_WORKER_INNER_ADAM_H_
#define MORSE_WORKER_INNER_ADAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/layout.h"
#include "worker/workload.h"

namespace morse::worker {

class InnerAdam {
 public:
  InnerAdam(const compress::AlgorithmConfig& config, uint64_t dim);

  // Inner steps per outer step (sync_every / fragments).
  int64_t steps() const {
    return config_.diloco.sync_every / config_.diloco.fragments;
  }

  // Inner steps taken over the whole run.
  int64_t taken() const { return taken_; }

  // Outer step `step`'s inner steps h in [begin, end) (the workload's step
  // numbers step * steps() + h), continuing from taken() == step * steps() +
  // begin; returns their summed loss. Before h = 0 of step 0 this worker's
  // parameters become `outer`; before h = diloco.overlap_steps of a later
  // step they merge step - 1's outer parameters `outer`
  // (compress::MergeOuter), which is the only time `outer` is read.
  absl::StatusOr<double> Steps(int64_t step, int64_t begin, int64_t end,
                               Workload& workload,
                               absl::Span<const float> outer);
  // Seconds the last Steps call spent merging the outer parameters (not an
  // inner step's time: StepRecord.inner_step_seconds leaves it out).
  double merge_seconds() const { return merge_seconds_; }
  // x_outer - x_local to `pseudo_gradient`.
  void PseudoGradient(absl::Span<const float> outer,
                      absl::Span<float> pseudo_gradient) const;

  // All of outer step `step`'s inner steps (without overlap) from `outer`;
  // writes x_outer - x_local to `pseudo_gradient` and returns the inner
  // steps' mean loss.
  absl::StatusOr<double> Run(int64_t step, Workload& workload,
                             absl::Span<const float> outer,
                             absl::Span<float> pseudo_gradient);
  // The same in two parts, for workloads that compute ranges
  // (Workload::ComputesRanges): every inner step but the last (returns
  // their summed loss), then the last one range at a time, in increasing
  // order, each once. A range's pseudo-gradient is final once LastStepRange
  // returns, so it can be pushed while the rest is computed; the bits are
  // Run's. `outer` must not change in a range before its LastStepRange.
  absl::StatusOr<double> RunAllButLast(int64_t step, Workload& workload,
                                       absl::Span<const float> outer);
  absl::Status LastStepRange(int64_t step, Workload& workload,
                             absl::Span<const float> outer,
                             absl::Span<float> pseudo_gradient, uint64_t begin,
                             uint64_t end, double loss_lanes[4]);

  // m and v after `step` outer steps to `path` (atomically), for worker
  // `rank` of the job whose layout and algorithm have these fingerprints.
  absl::Status Save(const std::string& path, int64_t step, uint32_t rank,
                    uint64_t layout_fingerprint,
                    uint64_t algorithm_fingerprint) const;
  // m and v of `step` from such a file; FAILED_PRECONDITION, saying why
  // and changing nothing, when it is missing or of another step, worker
  // or job; DATA_LOSS when it is corrupt.
  absl::Status Load(const std::string& path, int64_t step, uint32_t rank,
                    uint64_t layout_fingerprint,
                    uint64_t algorithm_fingerprint);

 private:
  // Adam's scalars of inner step `inner` (0-based, over the whole run).
  compress::AdamScalars Scalars(int64_t inner) const;

  // Whether this worker's own parameters outlive a sync (fragments not
  // synced, an overlap, mixing), so that Save/Load keep them.
  bool CarriesLocal() const;

  compress::AlgorithmConfig config_;
  compress::Layout layout_;
  compress::LrSchedule schedule_;  // over inner steps
  std::vector<float> x_, m_, v_, grad_;
  int64_t taken_ = 0;
  double merge_seconds_ = 0;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_INNER_ADAM_H_
