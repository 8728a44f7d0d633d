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
#include "compress/step_plan.h"

namespace morse::compress {
namespace {

// One phase of the variance schedule (design.md 2.7, 1-based steps):
// kappa updates at first, first + interval, ..., last.
struct VariancePhase {
  int64_t first = 0, last = 0, interval = 1;
  int64_t before = 0;  // updates in the phases before it
};

// The first phase of the schedule that does not end before step s.
VariancePhase PhaseReaching(int64_t kappa, int64_t s) {
  VariancePhase phase;
  int64_t end = 0;
  for (int k = 0; k < 62; ++k) {
    phase.interval = int64_t{1} << k;
    phase.first = (end / phase.interval + 1) * phase.interval;
    const int64_t span = kappa - 1;
    phase.last = span > (std::numeric_limits<int64_t>::max() - phase.first) /
                             phase.interval
                     ? std::numeric_limits<int64_t>::max()
                     : phase.first + span * phase.interval;
    if (s <= phase.last) return phase;
    phase.before += kappa;
    end = phase.last;
  }
  phase.first = phase.last = std::numeric_limits<int64_t>::max();
  return phase;
}

// The variance schedule at 1-based step s <= F: phase k updates v at kappa
// steps spaced 2^k apart, starting at the first multiple of 2^k after the
// previous phase's last update. Returns the updates at steps <= s; *at_s:
// whether s is one.
int64_t VarianceUpdates(int64_t kappa, int64_t s, bool* at_s) {
  const VariancePhase phase = PhaseReaching(kappa, s);
  *at_s = s >= phase.first && (s - phase.first) % phase.interval == 0;
  if (s < phase.first) return phase.before;
  return phase.before + (s - phase.first) / phase.interval + 1;
}

// The first variance step at or after 1-based step s (past F too).
int64_t NextVarianceStep(int64_t kappa, int64_t s) {
  const VariancePhase phase = PhaseReaching(kappa, s);
  if (s <= phase.first) return phase.first;
  const int64_t into = s - phase.first + phase.interval - 1;
  return phase.first + into / phase.interval * phase.interval;
}

// zero_one_adam's v correction at `step`: 1 - b2^n_v, v having been
// updated n_v times (a segment added mid-job: since its first step;
// before its first variance step, where it is masked whole, 1), b2 the
// step's (`hyper`'s where the workers set it, as torch's Adam corrects by
// the step's betas).
float ZeroOneVarianceCorrection(const AlgorithmConfig& config, int64_t step,
                                const StepHyper* hyper) {
  int64_t updates = ZeroOneAt(config, step).variance_updates;
  if (hyper != nullptr && hyper->first_step > 0)
    updates -= ZeroOneAt(config, hyper->first_step - 1).variance_updates;
  return MakeAdamScalars(StepAdamHyper(config, hyper), 0.0f,
                         std::max<int64_t>(1, updates), true)
      .bias_correction2;
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

  // A group added mid-job (StepHyper::first_step k) counts its updates
  // from the schedule's first variance step at or after k, its v being 0
  // until then: the 1-bit steps before it mask the whole segment (2.1's
  // zero-variance mask), so that its gradients there move nothing (its
  // weight decay still does). The schedules stay the job's (design.md 2.7).
  bool CountsFromFirstStep() const override { return true; }
  absl::StatusOr<int64_t> FirstCountedStep(const AlgorithmConfig& c,
                                           int64_t first_step) const override {
    const ZeroOneSpec& z = c.zero_one;
    const int64_t s = NextVarianceStep(z.var_update_scaler, first_step + 1);
    if (s > z.var_freeze_step) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a segment whose parameters train since step ", first_step,
          ", after zero_one_adam's last variance step before var_freeze_step ",
          z.var_freeze_step, ": its variance would freeze before it had any"));
    }
    if (s != first_step + 1 && !c.mask_zero_variance) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a segment whose parameters train since step ", first_step,
          ", a 1-bit step of zero_one_adam, with mask_zero_variance off: "
          "until its first variance step (step ",
          s - 1,
          ") nothing would hold its v = 0 elements still; add it right "
          "before a variance step"));
    }
    return s - 1;
  }

  // A worker's local interval (Replica::LocalStep): x at its start, the
  // update accumulated since, and each segment's learning-rate sum.
  std::vector<StateArray> IntervalState(
      const AlgorithmConfig& c) const override {
    return {{"anchor"}, {"u"}, {"lr_sum", false, c.layout.cuts.size() + 1}};
  }
  // Parameter groups: each segment's local steps take its own lr and
  // weight_decay, and its sync its own interval's sum (Replica::LocalStep).
  bool HyperByPartition() const override { return true; }
  // Every phase takes the step's betas and eps: its reply rules, local
  // momentum, local steps and sync message (design.md 2.7).
  bool FollowsStepMoments() const override { return true; }

  // A sync's push is the interval's mean update (Replica::SyncMessage),
  // formed with eps and v's correction at the step's betas and eps.
  void PlanSend(const AlgorithmConfig& c, int64_t step,
                const StepPlan& /*plan*/, const StepHyper* hyper,
                SendRule& rule) const override {
    if (rule.accumulated) rule.sync = LocalStepScalars(c, step, hyper);
  }

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
