// onebit_adam: 1-bit Adam (Tang et al. 2021, "1-bit Adam:
// Communication Efficient Large-Scale Training with Adam's Convergence
// Speed"), design.md 2.1. Steps t < T_w (freeze_step) are Adam on the
// averaged gradient in warmup_codec, without error feedback. From T_w on, v
// is frozen and the momentum is what travels:
//   worker i: m_i = b1*m + (1-b1)*g_i, pushes c_i = C(m_i + e_i);
//   shard:    replies c = C(avg(c_i) + e_s);
//   replicas: m = c, x = x - lr * (clamp(m-hat / (sqrt(v-hat) + eps), +-R)
//             + wd*x), v-hat = v / (1 - b2^T_w),
// elements with a frozen v of exactly 0 masked to +0 throughout.
#include "absl/strings/str_cat.h"
#include "compress/optimizer.h"

namespace morse::compress {

absl::Status ValidateFreezeStep(const AlgorithmConfig& c,
                                absl::string_view name) {
  if (absl::Status s =
          ValidateWarmupCodec(c, absl::StrCat("the warmup codec of ", name));
      !s.ok()) {
    return s;
  }
  if (c.freeze_step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("freeze_step must be at least 1 for ", name,
                     " (with no warmup there is no variance to freeze)"));
  }
  return absl::OkStatus();
}

StepPlan FreezeStepPlan(const AlgorithmConfig& c, int64_t step) {
  return step < c.freeze_step ? FullPrecisionPlan(c) : CompressedPlan(c);
}

namespace {

class OneBitAdam final : public Optimizer {
 public:
  absl::string_view name() const override { return "onebit_adam"; }
  OptimizerKind kind() const override { return OptimizerKind::kOneBitAdam; }

  absl::Status Validate(const AlgorithmConfig& c) const override {
    return ValidateFreezeStep(c, name());
  }

  StepPlan Plan(const AlgorithmConfig& c, int64_t step) const override {
    return FreezeStepPlan(c, step);
  }

  const char* Phase(const StepPlan& plan) const override {
    return plan.compressing ? "compression" : "warmup";
  }

  void PlanReply(const AlgorithmConfig& c, int64_t, const StepPlan& plan,
                 const StepHyper* hyper, ReplyRule& rule) const override {
    if (plan.compressing) FrozenVarianceScalars(c, hyper, rule);
  }

  bool HasFreezeStep() const override { return true; }

  // Every use of lr and weight_decay is a partition's reply rule.
  bool HyperByPartition() const override { return true; }
  // Its moments, bias corrections, local momentum (PlanSend), frozen-variance
  // correction and bound take the step's betas and eps (design.md 2.1, 2.2).
  bool FollowsStepMoments() const override { return true; }
  // Its only count of steps is StepScalars' and FrozenVarianceScalars'.
  bool CountsFromFirstStep() const override { return true; }
};

}  // namespace

const Optimizer& OneBitAdamOptimizer() {
  static const OneBitAdam* const optimizer = new OneBitAdam;
  return *optimizer;
}

}  // namespace morse::compress
