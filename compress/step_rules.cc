#include "compress/step_rules.h"

#include "absl/strings/str_cat.h"

namespace morse::compress {

size_t SendBytes(const SendRule& rule, uint64_t n) {
  return rule.idle ? 0 : PayloadBytes(rule.codec, n);
}

const StepHyper* HyperOf(absl::Span<const StepHyper> hypers, uint32_t segment) {
  if (hypers.empty()) return nullptr;
  return &hypers[hypers.size() == 1 ? 0 : segment];
}

absl::Status CheckHyperCount(absl::Span<const StepHyper> hypers,
                             uint32_t segments) {
  if (hypers.size() <= 1 || hypers.size() == segments) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      hypers.size(), " learning rates and weight decays for a model of ",
      segments,
      " parameter groups (the job's external.groups): give one, or one per "
      "group"));
}

}  // namespace morse::compress
