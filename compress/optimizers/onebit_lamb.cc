// onebit_lamb: 1-bit LAMB (Li et al. 2021, "1-bit LAMB: Communication
// Efficient Large-Scale Large-Batch Training with LAMB's Convergence
// Speed"), design.md 2.8, with DeepSpeed's OnebitLamb names. The exchange
// is 1-bit Adam's (onebit_adam.cc: fp32 warmup before freeze_step, then
// compressed momentum with error feedback on both sides); what LAMB adds
// happens on every replica after the replies. A reply moves m, v and the
// fresh variance v' (LambMoments); then each layer l moves by its own
// coefficient from sums over the whole layer:
//   warmup:      coeff_l = clamp(||x_l|| / ||u_l||, min_coeff, max_coeff),
//                coeff_freeze_l = coeff_beta * coeff_freeze_l
//                                 + (1 - coeff_beta) * coeff_l;
//   compression: coeff_l = coeff_freeze_l * factor_l, factor_l from v' and
//                clamped to [factor_min, factor_max] and to within
//                factor_threshold of the last;
//   x_l = x_l - lr * coeff_l * u_l (LambMoveX).
// The sums over a layer are its layer rule's statistics (compress/layers.h):
// a worker computes the layers' commit; the shards' mirrors receive it
// (CommitDoubles) before they move x.
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/lamb.h"
#include "compress/optimizer.h"

namespace morse::compress {
namespace {

// Statistics [sum x^2, sum u^2, 0] (warmup) or [sum u^2, sum p^2,
// max d/d'] (compression); each layer commits [coefficient, coeff_freeze,
// last_factor], its state the last two (FlattenLambLayers' order).
class LambLayers final : public LayerRule {
 public:
  int stats() const override { return kLambStats; }
  int commit_values() const override { return kLambCommit; }

  void SegmentStats(const ReplyRule& rule, const float* x, const float* m,
                    const float* v, const float* fresh, uint64_t n,
                    double* out) const override {
    LambSegmentSums(rule, x, m, v, fresh, n, out);
  }

  void Add(const double* part, double* total) const override {
    static_assert(kLambStats == 3);
    total[0] += part[0];
    total[1] += part[1];
    total[2] = part[2] > total[2] ? part[2] : total[2];
  }

  void Commit(const AlgorithmConfig& c, const ReplyRule& rule,
              const double* totals, size_t layer, absl::Span<const float> state,
              double* out) const override {
    LambLayerCommit(c.lamb, rule, totals,
                    {state[2 * layer], state[2 * layer + 1]}, out);
  }

  absl::Status ValidateLayer(size_t layer,
                             absl::Span<const double> values) const override {
    return ValidateLambLayerCommit(layer, values);
  }

  void MoveX(const ReplyRule& rule, const double* commit, float* x,
             const float* m, const float* v, uint64_t n) const override {
    LambMoveX(rule, commit, x, m, v, n);
  }
};

class OneBitLamb final : public Optimizer {
 public:
  absl::string_view name() const override { return "onebit_lamb"; }
  OptimizerKind kind() const override { return OptimizerKind::kOneBitLamb; }

  absl::Status Validate(const AlgorithmConfig& c) const override {
    if (absl::Status s = ValidateFreezeStep(c, name()); !s.ok()) return s;
    const LambSpec& l = c.lamb;
    const auto finite = [](float f) { return std::isfinite(f); };
    if (!(l.min_coeff > 0.0f) || !(l.max_coeff >= l.min_coeff) ||
        !finite(l.max_coeff)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "onebit_lamb needs 0 < min_coeff <= max_coeff (finite), got ",
          l.min_coeff, ", ", l.max_coeff));
    }
    if (!(l.coeff_beta >= 0.0f && l.coeff_beta < 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "onebit_lamb.coeff_beta must be in [0, 1), got ", l.coeff_beta));
    }
    if (!(l.factor_min > 0.0f) || !(l.factor_max >= l.factor_min) ||
        !finite(l.factor_max)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "onebit_lamb needs 0 < factor_min <= factor_max (finite), got ",
          l.factor_min, ", ", l.factor_max));
    }
    if (!(l.factor_threshold >= 0.0f && l.factor_threshold < 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("onebit_lamb.factor_threshold must be in [0, 1), got ",
                       l.factor_threshold));
    }
    return LayerSegments(c, name()).status();
  }

  void Fingerprint(const AlgorithmConfig& c, Fnv64& hash) const override {
    for (float f :
         {c.lamb.max_coeff, c.lamb.min_coeff, c.lamb.coeff_beta,
          c.lamb.factor_max, c.lamb.factor_min, c.lamb.factor_threshold}) {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      hash.MixInt(bits);
    }
    hash.MixInt(c.layers.size());
    for (uint64_t size : c.layers) hash.MixInt(size);
  }

  StepPlan Plan(const AlgorithmConfig& c, int64_t step) const override {
    return FreezeStepPlan(c, step);
  }

  const char* Phase(const StepPlan& plan) const override {
    return plan.compressing ? "compression" : "warmup";
  }

  void PlanReply(const AlgorithmConfig& c, int64_t step, const StepPlan& plan,
                 const StepHyper* hyper, ReplyRule& rule) const override {
    rule.lamb = true;
    rule.fresh_correction2 = rule.scalars.bias_correction2;
    rule.copy_fresh = step + 1 == c.freeze_step;
    if (plan.compressing) FrozenVarianceScalars(c, hyper, rule);
  }

  bool HasFreezeStep() const override { return true; }
  // Parameter groups: every element's direction and every layer's step take
  // its group's lr and weight_decay, and a layer's coefficient its group's
  // weight_decay (LambCommit); groups start on layers (LayerSegments).
  bool HyperByPartition() const override { return true; }
  // 1-bit Adam's exchange with the step's betas and eps, and LAMB's moments,
  // fresh variance and layer sums from the same reply rules (design.md 2.8).
  bool FollowsStepMoments() const override { return true; }
  // A group added mid-job (StepHyper::first_step k): its counts of steps are
  // StepScalars' and FrozenVarianceScalars' corrections (bc2' too, which is
  // the rule's bc2), and its layers' coefficient state starts where a job's
  // does (c̄ = 0, f = 1) at k, as morse.torch lays it out; the v' copy at
  // the freeze is the job's step, which k < freeze_step precedes.
  bool CountsFromFirstStep() const override { return true; }

  // v' over the replica's range; each layer's coeff_freeze and last_factor
  // (FlattenLambLayers' order).
  std::vector<StateArray> State(const AlgorithmConfig& c) const override {
    return {{"v_fresh", true, 0}, {"lamb_layers", false, 2 * LayerCount(c)}};
  }

  std::vector<float> InitialState(const AlgorithmConfig& c,
                                  const StateArray&) const override {
    return FlattenLambLayers(std::vector<LambLayerState>(LayerCount(c)));
  }

  std::vector<std::vector<float>> StateAfterCommit(
      const AlgorithmConfig&, absl::Span<const double> commit) const override {
    return {FlattenLambLayers(LambStateOf(commit))};
  }

  absl::Status ValidateState(absl::Span<const NamedState> state,
                             absl::string_view what) const override {
    return ValidateSavedLamb(state[0].values, state[1].values, what);
  }

  const LayerRule* Layers() const override { return &layers_; }

 private:
  LambLayers layers_;
};

}  // namespace

const Optimizer& OneBitLambOptimizer() {
  static const OneBitLamb* const optimizer = new OneBitLamb;
  return *optimizer;
}

}  // namespace morse::compress
