// The rules of a step as data: what it sends in each direction (StepPlan,
// SendRule) and how every replica applies its reply (ReplyRule). The
// optimizers fill them in (compress/optimizer.h) and compress/step_plan.h's
// functions hand them out; what reads them (encoders, update loops, layer
// rules) needs this file alone.
#ifndef MORSE_COMPRESS_STEP_RULES_H_
#define MORSE_COMPRESS_STEP_RULES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/codec.h"
#include "compress/update_rules.h"

namespace morse::compress {

// What step t of a job sends in each direction.
struct StepPlan {
  bool compressing = false;  // frozen v: 1-bit Adam after the freeze step, 0/1
                             // Adam between v's updates
  bool feedback = false;     // error feedback on (never in 1-bit warmup)
  // zero_one_adam's local phase (design.md 2.7): workers step on their own
  // and push only at syncs (`exchanges`), the mean of their updates.
  bool local = false;
  bool exchanges = true;  // false: a local step, nothing is sent
  CodecSpec up;
  CodecSpec down;
};

// The sender's rule (DESIGN 2.1-2.4) for one partition in one step: what a
// worker pushes (`up`) or a shard replies (`down`). PlanSend
// (compress/step_plan.h) makes it; every sender reads it: CPU and GPU
// workers, shards, the simulator.
struct SendRule {
  CodecSpec codec;
  // Send the local momentum b1*m + (1-b1)*g instead of g (1-bit Adam's
  // compression phase; workers only).
  bool local_momentum = false;
  float beta1 = 0;
  // Send the sync message of zero_one_adam's local phase
  // (Replica::SyncMessage; workers only), formed with `sync`: eps and v's
  // correction at the step's betas and eps (LocalStepScalars).
  bool accumulated = false;
  int64_t step = 0;
  AdamScalars sync;
  // Encode through the sender's error buffer (ErrorFeedback::Compress);
  // off in 1-bit Adam's warmup.
  bool feedback = false;
  // DESIGN 2.1's zero-variance mask: elements whose v is exactly 0 send +0
  // and keep +0 error (ErrorFeedback::Compress's mask_v).
  bool mask = false;
  // Nothing to send: an idle partition's payload is empty (Idle).
  bool idle = false;
  RoundingKey key;
};
// The payload bytes of `n` elements under `rule`: 0 when idle.
size_t SendBytes(const SendRule& rule, uint64_t n);
enum class Direction { kUp, kDown };

// The reply's rule: how every replica (worker CPU and GPU, shard mirror,
// simulator) turns a step's decoded reply into an update of x, m, v.
// PlanReply (compress/step_plan.h) makes it.
struct ReplyRule {
  CodecSpec codec;               // the reply's encoding
  bool frozen_variance = false;  // FrozenVarianceStep; else AdamStep, or
  // zero_one_adam's variance step with its bounded ratio (ZeroOneVarianceStep)
  bool bounded_variance = false;
  // zero_one_adam's sync (ZeroOneSyncStep, scalars.lr the interval's
  // learning-rate sum); the others are off.
  bool sync = false;
  // The zero-variance mask: decoded values where v is exactly 0 become +0.
  bool mask = false;
  // Bias correction 1 - b1^t' and 1 - b2^t' (1 - b2^T_w once frozen), or 1.
  AdamScalars scalars;
  // The clip factor of the averaged gradient (ClipScale), applied to the
  // decoded values before the update; 1: unclipped (the same bits as no
  // clipping at all).
  float grad_scale = 1.0f;
  // onebit_lamb (compress/lamb.h): the reply moves m, v and the fresh
  // variance v' only (LambMoments); x follows the step's commit
  // (LambMoveX). frozen_variance says which phase; v' is corrected by
  // 1 - b2^t' (fresh_correction2), and copied from v at the last warmup
  // step (copy_fresh).
  bool lamb = false;
  float fresh_correction2 = 1.0f;
  bool copy_fresh = false;
  // diloco: the reply is the averaged pseudo-gradient, and x and m (the
  // outer momentum) take the outer step (OuterStep); v is not used.
  bool outer = false;
  OuterScalars outer_scalars;
};

// A step's learning rates and weight decays as the workers set them
// (Session::SetStepHyper): none (the job's schedule), one for the whole
// model, or one per segment of the layout (parameter groups,
// Optimizer::HyperByPartition). Segment `segment`'s, or null for none.
const StepHyper* HyperOf(absl::Span<const StepHyper> hypers, uint32_t segment);
// OK, or INVALID_ARGUMENT naming both counts, unless `hypers` are none, one,
// or one per segment of a layout of `segments` (as HyperOf reads them).
absl::Status CheckHyperCount(absl::Span<const StepHyper> hypers,
                             uint32_t segments);
// One rule for the whole model, or one per segment (PlanReplies): segment
// `segment`'s.
inline const ReplyRule& RuleOf(absl::Span<const ReplyRule> rules,
                               uint32_t segment) {
  return rules[rules.size() == 1 ? 0 : segment];
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_STEP_RULES_H_
