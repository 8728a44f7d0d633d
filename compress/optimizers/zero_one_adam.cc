// zero_one_adam: 0/1 Adam (Lu et al. 2022, "Maximizing Communication
// Efficiency for Large-scale Training via 0/1 Adam"), design.md 2.7, on
// DeepSpeed's ZeroOneAdam schedule. With s = t + 1, F = var_freeze_step:
//   s <= F, a variance step (kappa steps at intervals 1, 2, 4, ...):
//     Adam on the averaged gradient in warmup_codec, the ratio bounded by R,
//     v-hat = v / (1 - b2^n_v(s));
//   s <= F otherwise: 1-bit Adam's compressed momentum with error feedback,
//     v frozen since the last variance step;
//   s > F: workers take local steps x -= lr * m / (sqrt(v-hat) + eps) and
//     push only every I = min(H, 2^floor((s - F - 1) / S)) steps the
//     interval's mean update, whose compressed average every replica syncs to.
#include "compress/optimizers/zero_one_adam.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "compress/optimizer.h"

namespace morse::compress {
namespace {

// zero_one_adam's v correction at `step`: 1 - b2^n_v, v having been
// updated n_v times, b2 the step's (`hyper`'s where the workers set it, as
// torch's Adam corrects by the step's betas).
float ZeroOneVarianceCorrection(const AlgorithmConfig& config, int64_t step,
                                const StepHyper* hyper) {
  return MakeAdamScalars(StepAdamHyper(config, hyper), 0.0f,
                         ZeroOneAt(config, step).variance_updates, true)
      .bias_correction2;
}

// The variance schedule (design.md 2.7) at 1-based step s <= F: phase k
// updates v at kappa steps spaced 2^k apart, starting at the first multiple
// of 2^k after the previous phase's last update. Returns the updates at
// steps <= s; *at_s: whether s is one.
int64_t VarianceUpdates(int64_t kappa, int64_t s, bool* at_s) {
  *at_s = false;
  int64_t end = 0, count = 0;
  for (int k = 0; k < 62; ++k) {
    const int64_t interval = int64_t{1} << k;
    const int64_t first = (end / interval + 1) * interval;
    if (s < first) return count;
    const int64_t span = kappa - 1;
    const int64_t last =
        span > (std::numeric_limits<int64_t>::max() - first) / interval
            ? std::numeric_limits<int64_t>::max()
            : first + span * interval;
    if (s <= last) {
      *at_s = (s - first) % interval == 0;
      return count + (s - first) / interval + 1;
    }
    count += kappa;
    end = last;
  }
  return count;
}

}  // namespace

ZeroOneStep ZeroOneAt(const AlgorithmConfig& config, int64_t step) {
  const ZeroOneSpec& z = config.zero_one;
  ZeroOneStep at;
  const int64_t s = step + 1;
  if (s <= z.var_freeze_step) {
    at.variance_updates = VarianceUpdates(z.var_update_scaler, s, &at.variance);
    return at;
  }
  bool unused;
  at.variance_updates =
      VarianceUpdates(z.var_update_scaler, z.var_freeze_step, &unused);
  at.local = true;
  const int64_t doublings = (s - z.var_freeze_step - 1) / z.local_step_scaler;
  at.interval = doublings >= 62
                    ? z.local_step_clipper
                    : std::min(z.local_step_clipper, int64_t{1} << doublings);
  at.exchanges = s % at.interval == 0;
  return at;
}

bool StartsInterval(const AlgorithmConfig& config, int64_t step) {
  if (config.optimizer != OptimizerKind::kZeroOneAdam ||
      !ZeroOneAt(config, step).local) {
    return false;
  }
  return step == config.zero_one.var_freeze_step ||
         ZeroOneAt(config, step - 1).exchanges;
}

absl::StatusOr<bool> BeginLocalStep(const AlgorithmConfig& config, int64_t step,
                                    int64_t last_step) {
  if (!PlanStep(config, step).local) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is not in zero_one_adam's local phase"));
  }
  if (StartsInterval(config, step)) return true;
  if (last_step != step - 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step,
                     " is in the middle of a zero_one_adam local interval that "
                     "this worker did not "
                     "start; it can resume only at the step after a sync"));
  }
  return false;
}

float IntervalLrSum(const AlgorithmConfig& config, int64_t step) {
  int64_t first = step;
  while (!StartsInterval(config, first)) --first;
  float sum = 0.0f;
  for (int64_t t = first; t <= step; ++t) sum += LearningRate(config.lr, t);
  return sum;
}

AdamScalars LocalStepScalars(const AlgorithmConfig& config, int64_t step,
                             const StepHyper* hyper) {
  AdamScalars s = StepScalars(config, step, hyper, /*bias_correction=*/false);
  if (config.bias_correction)
    s.bias_correction2 = ZeroOneVarianceCorrection(config, step, hyper);
  if (config.bound_update)
    s.max_ratio = OneBitUpdateBound(StepAdamHyper(config, hyper));
  return s;
}

namespace {

class ZeroOneAdam final : public Optimizer {
 public:
  absl::string_view name() const override { return "zero_one_adam"; }
  OptimizerKind kind() const override { return OptimizerKind::kZeroOneAdam; }

  absl::Status Validate(const AlgorithmConfig& c) const override {
    const ZeroOneSpec& z = c.zero_one;
    constexpr int64_t kMax = int64_t{1} << 40;
    for (const auto& [name, value] :
         {std::pair<const char*, int64_t>{"var_freeze_step", z.var_freeze_step},
          {"var_update_scaler", z.var_update_scaler},
          {"local_step_scaler", z.local_step_scaler},
          {"local_step_clipper", z.local_step_clipper}}) {
      if (value < 1 || value > kMax) {
        return absl::InvalidArgumentError(absl::StrCat(
            "zero_one_adam.", name, " must be in [1, 2^40], got ", value));
      }
    }
    return ValidateWarmupCodec(
        c, "zero_one_adam's variance steps use warmup_codec, which");
  }

  void Fingerprint(const AlgorithmConfig& c, Fnv64& hash) const override {
    hash.MixInt(static_cast<uint64_t>(c.zero_one.var_freeze_step));
    hash.MixInt(static_cast<uint64_t>(c.zero_one.var_update_scaler));
    hash.MixInt(static_cast<uint64_t>(c.zero_one.local_step_scaler));
    hash.MixInt(static_cast<uint64_t>(c.zero_one.local_step_clipper));
  }

  StepPlan Plan(const AlgorithmConfig& c, int64_t step) const override {
    const ZeroOneStep z = ZeroOneAt(c, step);
    if (z.variance) return FullPrecisionPlan(c);
    StepPlan plan = CompressedPlan(c);
    plan.local = z.local;
    plan.exchanges = z.exchanges;
    return plan;
  }

  const char* Phase(const StepPlan& plan) const override {
    if (plan.local) return plan.exchanges ? "sync" : "local";
    return plan.compressing ? "compression" : "variance";
  }

  int64_t NextExchange(const AlgorithmConfig& c, int64_t step) const override {
    while (!ZeroOneAt(c, step).exchanges)
      ++step;  // at most local_step_clipper - 1 steps
    return step;
  }

  bool StepsLocally() const override { return true; }
  // Parameter groups: each segment's local steps take its own lr and
  // weight_decay, and its sync its own interval's sum (Replica::LocalStep).
  bool HyperByPartition() const override { return true; }
  // Every phase takes the step's betas and eps: its reply rules, local
  // momentum, local steps and sync message (design.md 2.7).
  bool FollowsStepMoments() const override { return true; }

  void PlanReply(const AlgorithmConfig& c, int64_t step, const StepPlan& plan,
                 const StepHyper* hyper, ReplyRule& rule) const override {
    if (plan.local) {
      // The sync: the interval's learning-rate sum (the workers' pushes
      // carry their segment's as their lr when they set one), v-hat as in
      // the local steps.
      rule.scalars = LocalStepScalars(c, step, hyper);
      rule.scalars.lr = hyper != nullptr ? hyper->lr : IntervalLrSum(c, step);
      return;
    }
    if (c.bias_correction)
      rule.scalars.bias_correction2 = ZeroOneVarianceCorrection(c, step, hyper);
    if (!c.bound_update) return;
    rule.scalars.max_ratio = OneBitUpdateBound(StepAdamHyper(c, hyper));
    // A variance step's m comes from the 1-bit steps before it, not from
    // gradients alone as Adam's does: bounded like them (design.md 2.7).
    if (!plan.compressing) rule.bounded_variance = true;
  }
};

}  // namespace

const Optimizer& ZeroOneAdamOptimizer() {
  static const ZeroOneAdam* const optimizer = new ZeroOneAdam;
  return *optimizer;
}

}  // namespace morse::compress
