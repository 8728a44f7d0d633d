// zero_one_adam's schedule (design.md 2.7), which its optimizer
// (zero_one_adam.cc) plans by and every replica's local step reads.
#ifndef MORSE_COMPRESS_OPTIMIZERS_ZERO_ONE_ADAM_H_
#define MORSE_COMPRESS_OPTIMIZERS_ZERO_ONE_ADAM_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "compress/algorithm.h"
#include "compress/update_rules.h"

namespace morse::compress {

// zero_one_adam's schedule at step `step` (0-based; design.md 2.7).
struct ZeroOneStep {
  bool variance = false;         // a full-precision exchange that updates v
  int64_t variance_updates = 0;  // v's updates in steps 0..step (n_v)
  bool local = false;            // the local phase (step >= var_freeze_step)
  int64_t interval = 1;          // the local phase's interval at this step
  bool exchanges = true;         // the workers push at this step
};
ZeroOneStep ZeroOneAt(const AlgorithmConfig& config, int64_t step);
// Whether `step` begins an interval of zero_one_adam's local phase (the
// first local step, or the step after a sync): workers reset their
// accumulated update and take x as the new anchor.
bool StartsInterval(const AlgorithmConfig& config, int64_t step);
// Whether zero_one_adam's local step `step` starts an interval (the
// replica resets its anchor, accumulated update and learning-rate sum) or
// continues the one whose last local step was `last_step`.
// FAILED_PRECONDITION outside the local phase, or in the middle of an
// interval the replica did not start. Every engine's LocalStep asks it.
absl::StatusOr<bool> BeginLocalStep(const AlgorithmConfig& config, int64_t step,
                                    int64_t last_step);
// The learning rates of the schedule summed in fp32, in step order, over
// the interval that ends with sync step `step` (zero_one_adam).
float IntervalLrSum(const AlgorithmConfig& config, int64_t step);
// The scalars of a zero_one_adam local step (ZeroOneLocalStep; with
// `hyper`'s lr and weight decay when the workers set them).
AdamScalars LocalStepScalars(const AlgorithmConfig& config, int64_t step,
                             const StepHyper* hyper);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_OPTIMIZERS_ZERO_ONE_ADAM_H_
