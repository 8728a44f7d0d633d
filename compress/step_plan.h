// The step plan: what step t of a job does, in both directions, for every
// optimizer. Each optimizer (compress/optimizer.h) decides its own part;
// these functions are the one place every sender and replica reads it:
// CPU and GPU workers, shards, their mirrors and the simulator.
#ifndef MORSE_COMPRESS_STEP_PLAN_H_
#define MORSE_COMPRESS_STEP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/step_rules.h"

namespace morse::compress {

// What step `step` (0-based) sends in each direction.
StepPlan PlanStep(const AlgorithmConfig& config, int64_t step);
// The phase of `step` in words, for logs and errors: "adam"; onebit_adam's
// "warmup" or "compression"; zero_one_adam's "variance", "compression",
// "local" or "sync".
const char* PhaseName(const AlgorithmConfig& config, int64_t step);
// The first step >= `step` at which the workers push (`step` itself except
// between zero_one_adam's syncs).
int64_t NextExchange(const AlgorithmConfig& config, int64_t step);
// Whether weights changed between steps `step` − 1 and `step` can become
// the job's (design.md 4, "Weights changed after a step"): `step` exchanges,
// or the step before it did (a zero_one_adam interval begins, whose anchor
// they become). Not inside such an interval, whose shards hold its anchor.
bool TakesChangedX(const AlgorithmConfig& config, int64_t step);

// Whether the partition starting at `first_index` sits step `step` out
// (Optimizer::Idle): every sender sends it empty, and every replica leaves
// it as it is.
bool Idle(const AlgorithmConfig& config, int64_t step, uint64_t first_index);

// The sender's rule for the partition starting at global element
// `first_index` in step `step`: sender = workers + shard, as SenderKey.
// `hyper`: the partition's StepHyper, whose beta1 (where it sets the
// moments) is the local momentum's.
SendRule PlanSend(const AlgorithmConfig& config, int64_t step,
                  Direction direction, uint32_t sender, uint64_t first_index,
                  const StepHyper* hyper = nullptr);

// The reply's rule of step `step`.
ReplyRule PlanReply(const AlgorithmConfig& config, int64_t step,
                    const StepHyper* hyper = nullptr, float grad_scale = 1.0f);

// PlanReply of every segment of the layout under `hypers` (as HyperOf):
// one rule for the whole model when there are fewer than two hypers, else
// one per segment. RuleOf (compress/step_rules.h) picks segment
// `segment`'s among them.
std::vector<ReplyRule> PlanReplies(const AlgorithmConfig& config, int64_t step,
                                   absl::Span<const StepHyper> hypers,
                                   float grad_scale = 1.0f);

// Gradient clipping (AlgorithmConfig::clip_grad_norm). Step `step` clips
// the averaged gradient: every replica needs the sum over all partitions of
// GradientSumOfSquares of each decoded reply (in partition order; a shard
// sends its partitions' with their replies) before it applies any of them.
bool ClipsAverage(const AlgorithmConfig& config, int64_t step);
// Step `step` clips each worker's own gradient (onebit_adam's compression
// phase): the worker needs its whole gradient before it sends anything.
bool ClipsLocally(const AlgorithmConfig& config, int64_t step);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_STEP_PLAN_H_
