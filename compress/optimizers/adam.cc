// adam: synchronous Adam on the workers' averaged gradient (Kingma & Ba
// 2015), design.md 2.2; the baseline every experiment compares with. Every
// step, with the job's up and down codecs and error feedback:
//   worker i pushes C_up(g_i + e_i); a shard averages in rank order and
//   replies C_down(avg + e_s); every replica then runs
//   m = b1*m + (1-b1)*c,  v = b2*v + (1-b2)*c^2,
//   x = x - lr * (m-hat / (sqrt(v-hat) + eps) + wd*x).
// With fp32 and no feedback it is exact Adam; with int4 and ema feedback it
// is LoCo (Xie et al. 2024).
#include "compress/optimizer.h"

namespace morse::compress {
namespace {

class Adam final : public Optimizer {
 public:
  absl::string_view name() const override { return "adam"; }
  OptimizerKind kind() const override { return OptimizerKind::kAdam; }

  StepPlan Plan(const AlgorithmConfig& c, int64_t) const override {
    return UnfrozenPlan(c);
  }

  const char* Phase(const StepPlan&) const override { return "adam"; }

  // v is never frozen: nothing to mask or bound.
  bool FreezesVariance() const override { return false; }

  // Every use of lr and weight_decay is a partition's reply rule.
  bool HyperByPartition() const override { return true; }
  // Its moments, bias corrections, local momentum (PlanSend), frozen-variance
  // correction and bound take the step's betas and eps (design.md 2.1, 2.2).
  bool FollowsStepMoments() const override { return true; }
  // Its only count of steps is StepScalars' and FrozenVarianceScalars'.
  bool CountsFromFirstStep() const override { return true; }
};

}  // namespace

const Optimizer& AdamOptimizer() {
  static const Adam* const optimizer = new Adam;
  return *optimizer;
}

}  // namespace morse::compress
