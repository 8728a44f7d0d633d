#include "compress/algorithm.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace morse::compress {

absl::Status ValidateStepHyper(const StepHyper& hyper) {
  if (!(hyper.lr >= 0.0f) || !std::isfinite(hyper.lr) ||
      !(hyper.weight_decay >= 0.0f) || !std::isfinite(hyper.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr ", hyper.lr, " and weight_decay ", hyper.weight_decay,
                     " must be finite and not negative"));
  }
  if (hyper.first_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_step ", hyper.first_step, " must not be negative"));
  }
  if (hyper.moments.has_value()) {
    const StepMoments& m = *hyper.moments;
    return ValidateAdamHyper(AdamHyper{m.beta1, m.beta2, m.eps, 0.0f});
  }
  return absl::OkStatus();
}

bool SameStepHyper(const std::optional<StepHyper>& a,
                   const std::optional<StepHyper>& b) {
  const auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  const auto same = [&](float x, float y) { return bits(x) == bits(y); };
  if (a.has_value() != b.has_value()) return false;
  if (!a.has_value()) return true;
  if (!same(a->lr, b->lr) || !same(a->weight_decay, b->weight_decay) ||
      a->first_step != b->first_step) {
    return false;
  }
  if (a->moments.has_value() != b->moments.has_value()) return false;
  return !a->moments.has_value() ||
         (same(a->moments->beta1, b->moments->beta1) &&
          same(a->moments->beta2, b->moments->beta2) &&
          same(a->moments->eps, b->moments->eps));
}

std::string DescribeStepHyper(const std::optional<StepHyper>& hyper) {
  if (!hyper.has_value()) return "the job's schedule";
  std::string out =
      absl::StrCat("lr ", hyper->lr, " and weight_decay ", hyper->weight_decay);
  if (hyper->moments.has_value()) {
    absl::StrAppend(&out, " with betas (", hyper->moments->beta1, ", ",
                    hyper->moments->beta2, ") and eps ", hyper->moments->eps);
  }
  if (hyper->first_step != 0) {
    absl::StrAppend(&out, ", its parameters training since step ",
                    hyper->first_step);
  }
  return out;
}

absl::Status CheckHyperAtStep(const StepHyper& hyper, int64_t step) {
  if (hyper.first_step <= step) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "step ", step, " of a parameter group that trains since step ",
      hyper.first_step));
}

absl::Status ValidateCommonAlgorithm(const AlgorithmConfig& c) {
  if (c.workers == 0)
    return absl::InvalidArgumentError("workers must be positive");
  if (absl::Status s = Layout::Create(c.layout).status(); !s.ok()) return s;
  if (absl::Status s = ValidateAdamHyper(c.adam); !s.ok()) return s;
  if (absl::Status s = ValidateLrSchedule(c.lr); !s.ok()) return s;
  for (const CodecSpec* codec : {&c.warmup_codec, &c.up_codec, &c.down_codec}) {
    if (absl::Status s = ValidateCodecSpec(*codec); !s.ok()) return s;
    if (codec->block_elems != c.layout.block_elems) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec block_elems (", codec->block_elems,
                       ") must equal the layout's block_elems (",
                       c.layout.block_elems, ")"));
    }
  }
  if (c.freeze_step < 0)
    return absl::InvalidArgumentError("freeze_step must be >= 0");
  if (!c.layers.empty()) {
    uint64_t sum = 0;
    for (uint64_t size : c.layers) {
      if (size == 0 || size > c.layout.dim) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer sizes must be in [1, dim], got ", size));
      }
      sum += size;
      if (sum > c.layout.dim) break;
    }
    if (sum != c.layout.dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("the layers' sizes must add up to the model's ",
                       c.layout.dim, " elements"));
    }
  }
  for (const FeedbackSpec* fb : {&c.worker_feedback, &c.server_feedback}) {
    if (absl::Status s = ValidateFeedbackSpec(*fb); !s.ok()) return s;
  }
  if (!(c.clip_grad_norm >= 0.0f) || !std::isfinite(c.clip_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "clip_grad_norm must be finite and not negative (0: no clipping), got ",
        c.clip_grad_norm));
  }
  return absl::OkStatus();
}

RoundingKey SenderKey(const AlgorithmConfig& config, int64_t step,
                      uint32_t sender_rank, uint64_t first_index) {
  return RoundingKey{config.seed, static_cast<uint64_t>(step), sender_rank,
                     first_index};
}

}  // namespace morse::compress
