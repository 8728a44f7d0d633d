#include "compress/optimizer.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/update_rules.h"

namespace morse::compress {

// compress/optimizers/, one file each.
const Optimizer& OneBitAdamOptimizer();
const Optimizer& AdamOptimizer();
const Optimizer& ZeroOneAdamOptimizer();
const Optimizer& OneBitLambOptimizer();
const Optimizer& DilocoOptimizer();

namespace {

// Every optimizer, in OptimizerKind's order.
const std::vector<const Optimizer*>& Optimizers() {
  static const auto* const all = new std::vector<const Optimizer*>{
      &OneBitAdamOptimizer(), &AdamOptimizer(), &ZeroOneAdamOptimizer(),
      &OneBitLambOptimizer(), &DilocoOptimizer()};
  return *all;
}

}  // namespace

absl::StatusOr<int64_t> Optimizer::FirstCountedStep(
    const AlgorithmConfig& config, int64_t first_step) const {
  if (HasFreezeStep() && first_step >= config.freeze_step) {
    return absl::InvalidArgumentError(
        absl::StrCat("a segment whose parameters train since step ", first_step,
                     ", at or after freeze_step ", config.freeze_step,
                     ": its variance would freeze before it had any"));
  }
  return first_step;
}

const Optimizer& OptimizerOf(OptimizerKind kind) {
  const Optimizer& optimizer = *Optimizers().at(static_cast<size_t>(kind));
  MORSE_CHECK(optimizer.kind() == kind);
  return optimizer;
}

const Optimizer& OptimizerOf(const AlgorithmConfig& config) {
  return OptimizerOf(config.optimizer);
}

const Optimizer* FindOptimizer(absl::string_view name) {
  for (const Optimizer* optimizer : Optimizers()) {
    if (optimizer->name() == name) return optimizer;
  }
  return nullptr;
}

std::string OptimizerNames() {
  std::string names;
  const std::vector<const Optimizer*>& all = Optimizers();
  for (size_t i = 0; i < all.size(); ++i) {
    if (i > 0) absl::StrAppend(&names, i + 1 == all.size() ? " or " : ", ");
    absl::StrAppend(&names, all[i]->name());
  }
  return names;
}

absl::Status Optimizer::ValidateCommit(const AlgorithmConfig& config,
                                       absl::Span<const double> commit) const {
  if (Layers() == nullptr) return absl::OkStatus();
  return ValidateCommitOfLayers(config, *Layers(), commit);
}

uint64_t Optimizer::CommitDoubles(const AlgorithmConfig& config) const {
  if (Layers() == nullptr) return 0;
  return Layers()->commit_values() * LayerCount(config);
}

absl::Status ValidateAlgorithmConfig(const AlgorithmConfig& c) {
  if (absl::Status s = ValidateCommonAlgorithm(c); !s.ok()) return s;
  return OptimizerOf(c).Validate(c);
}

absl::Status CheckStepHyper(const AlgorithmConfig& config,
                            const StepHyper& hyper) {
  if (absl::Status s = ValidateStepHyper(hyper); !s.ok()) return s;
  const Optimizer& optimizer = OptimizerOf(config);
  if (hyper.moments.has_value() && !optimizer.FollowsStepMoments()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "betas and eps set for a step of ", optimizer.name(),
        ", which applies the job's (adam, onebit_adam, zero_one_adam and "
        "onebit_lamb take them step by step)"));
  }
  if (hyper.first_step == 0) return absl::OkStatus();
  if (!optimizer.CountsFromFirstStep()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a segment whose parameters train since step ", hyper.first_step,
        " in a job of ", optimizer.name(),
        ", whose state counts from the job's first step (adam, onebit_adam, "
        "zero_one_adam and onebit_lamb count a group's own)"));
  }
  return optimizer.FirstCountedStep(config, hyper.first_step).status();
}

uint64_t AlgorithmFingerprint(const AlgorithmConfig& c) {
  Fnv64 hash;
  const auto mix = [&](uint64_t value) { hash.MixInt(value); };
  const auto mix_float = [&](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    mix(bits);
  };
  const auto mix_codec = [&](const CodecSpec& codec) {
    mix(static_cast<uint64_t>(codec.kind));
    mix(codec.block_elems);
    mix(static_cast<uint64_t>(codec.scale));
    mix(static_cast<uint64_t>(codec.rounding));
    uint64_t ratio;
    std::memcpy(&ratio, &codec.topk_ratio, 8);
    mix(ratio);
  };
  const auto mix_feedback = [&](const FeedbackSpec& fb) {
    mix(static_cast<uint64_t>(fb.kind));
    mix_float(fb.beta);
    mix(static_cast<uint64_t>(fb.storage));
  };
  mix(1);  // format version
  mix(static_cast<uint64_t>(c.optimizer));
  mix(c.workers);
  mix(c.layout.dim);
  mix(c.layout.shards);
  mix(c.layout.block_elems);
  mix(c.layout.partition_elems);
  for (float f : {c.adam.beta1, c.adam.beta2, c.adam.eps, c.adam.weight_decay})
    mix_float(f);
  mix(static_cast<uint64_t>(c.freeze_step));
  mix_codec(c.warmup_codec);
  mix_codec(c.up_codec);
  mix_codec(c.down_codec);
  mix_feedback(c.worker_feedback);
  mix_feedback(c.server_feedback);
  mix(c.bias_correction);
  mix(c.mask_zero_variance);
  mix(c.bound_update);
  if (c.clip_grad_norm > 0.0f)
    mix_float(c.clip_grad_norm);  // absent before clipping existed
  OptimizerOf(c).Fingerprint(c, hash);
  mix(c.seed);
  return hash.value();
}

bool CommitsLayers(const AlgorithmConfig& config) {
  return OptimizerOf(config).Layers() != nullptr;
}

bool StepsLocally(const AlgorithmConfig& config) {
  return !OptimizerOf(config).IntervalState(config).empty();
}

namespace {

// `state` holds `arrays` (the optimizer's), in order, each of its length
// (`elements` for per-element arrays, or with `may_be_empty` none where
// every per-element array is empty).
absl::Status CheckArrays(const Optimizer& optimizer,
                         const std::vector<StateArray>& arrays,
                         uint64_t elements, absl::Span<const NamedState> state,
                         absl::string_view what, bool may_be_empty) {
  const auto names = [](const auto& list) {
    std::string out;
    for (const auto& a : list)
      absl::StrAppend(&out, out.empty() ? "" : ", ", a.name);
    return out.empty() ? std::string("none") : out;
  };
  bool same_names = state.size() == arrays.size();
  for (size_t i = 0; same_names && i < arrays.size(); ++i)
    same_names = state[i].name == arrays[i].name;
  if (!same_names) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has the optimizer arrays [", names(state), "]; ",
                     optimizer.name(), " keeps [", names(arrays), "]"));
  }
  bool held = true;  // the per-element arrays hold values
  if (may_be_empty) {
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (arrays[i].per_element && state[i].values.empty()) held = false;
    }
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    const uint64_t want = !arrays[i].per_element ? arrays[i].floats
                          : held                 ? elements
                                                 : 0;
    if (state[i].values.size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has ", state[i].values.size(), " values of ",
                       state[i].name, "; ", optimizer.name(), " needs ", want));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckState(const AlgorithmConfig& config, uint64_t elements,
                        absl::Span<const NamedState> state,
                        absl::string_view what) {
  const Optimizer& optimizer = OptimizerOf(config);
  if (absl::Status s = CheckArrays(optimizer, optimizer.State(config), elements,
                                   state, what, /*may_be_empty=*/false);
      !s.ok()) {
    return s;
  }
  return optimizer.ValidateState(state, what);
}

absl::Status CheckInterval(const AlgorithmConfig& config, uint64_t elements,
                           absl::Span<const NamedState> interval,
                           absl::string_view what) {
  const Optimizer& optimizer = OptimizerOf(config);
  return CheckArrays(optimizer, optimizer.IntervalState(config), elements,
                     interval, what, /*may_be_empty=*/true);
}

uint64_t StateBytesPerElement(const AlgorithmConfig& config) {
  uint64_t bytes = 0;
  for (const StateArray& array : OptimizerOf(config).State(config)) {
    if (array.per_element) bytes += 4;
  }
  return bytes;
}

AdamHyper StepAdamHyper(const AlgorithmConfig& config, const StepHyper* hyper) {
  AdamHyper adam = config.adam;
  if (hyper != nullptr && hyper->moments.has_value()) {
    adam.beta1 = hyper->moments->beta1;
    adam.beta2 = hyper->moments->beta2;
    adam.eps = hyper->moments->eps;
  }
  return adam;
}

AdamScalars StepScalars(const AlgorithmConfig& config, int64_t step,
                        const StepHyper* hyper, bool bias_correction) {
  // The step's betas: its bias corrections too, as torch's Adam takes each
  // step's betas.
  AdamHyper adam = StepAdamHyper(config, hyper);
  if (hyper != nullptr) adam.weight_decay = hyper->weight_decay;
  const float lr = hyper != nullptr ? hyper->lr : LearningRate(config.lr, step);
  int64_t updates = step + 1;
  if (hyper != nullptr && hyper->first_step > 0) {
    MORSE_CHECK(hyper->first_step <= step);
    const absl::StatusOr<int64_t> counted =
        OptimizerOf(config).FirstCountedStep(config, hyper->first_step);
    MORSE_CHECK(counted.ok());  // CheckStepHyper
    // A segment held until a later step (zero_one_adam's, masked whole
    // until its first variance step) takes its first update's corrections
    // there: finite, and with m = v = 0 they move nothing.
    updates = std::max<int64_t>(1, step + 1 - *counted);
  }
  return MakeAdamScalars(adam, lr, updates, bias_correction);
}

StepPlan FullPrecisionPlan(const AlgorithmConfig& config) {
  StepPlan plan;
  plan.up = plan.down = config.warmup_codec;
  return plan;
}

StepPlan CompressedPlan(const AlgorithmConfig& config) {
  StepPlan plan;
  plan.compressing = true;
  plan.feedback = true;
  plan.up = config.up_codec;
  plan.down = config.down_codec;
  return plan;
}

StepPlan UnfrozenPlan(const AlgorithmConfig& config) {
  StepPlan plan = CompressedPlan(config);
  plan.compressing = false;
  return plan;
}

absl::Status ValidateWarmupCodec(const AlgorithmConfig& config,
                                 absl::string_view what) {
  const CodecKind warmup = config.warmup_codec.kind;
  if (warmup == CodecKind::kFp32 || warmup == CodecKind::kFp16 ||
      warmup == CodecKind::kBf16) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, " must be fp32, fp16 or bf16, got ", CodecName(warmup)));
}

void FrozenVarianceScalars(const AlgorithmConfig& config,
                           const StepHyper* hyper, ReplyRule& rule) {
  const AdamHyper adam = StepAdamHyper(config, hyper);
  if (config.bias_correction) {
    // v and its correction freeze together: 1 - b2^T_w.
    const int64_t first = hyper != nullptr ? hyper->first_step : 0;
    MORSE_CHECK(first < config.freeze_step);
    rule.scalars.bias_correction2 =
        MakeAdamScalars(adam, 0.0f, config.freeze_step - first, true)
            .bias_correction2;
  }
  if (config.bound_update) rule.scalars.max_ratio = OneBitUpdateBound(adam);
}

}  // namespace morse::compress
