#include "compress/optimizer.h"

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/update_rules.h"

namespace morse::compress {

// compress/optimizers/, one file each.
const Optimizer& OneBitAdamOptimizer();
const Optimizer& AdamOptimizer();
const Optimizer& ZeroOneAdamOptimizer();
const Optimizer& OneBitLambOptimizer();

namespace {

// Every optimizer, in OptimizerKind's order.
const std::vector<const Optimizer*>& Optimizers() {
  static const auto* const all = new std::vector<const Optimizer*>{
      &OneBitAdamOptimizer(), &AdamOptimizer(), &ZeroOneAdamOptimizer(),
      &OneBitLambOptimizer()};
  return *all;
}

}  // namespace

const Optimizer& OptimizerOf(OptimizerKind kind) {
  const Optimizer& optimizer = *Optimizers().at(static_cast<size_t>(kind));
  MORSE_CHECK(optimizer.kind() == kind);
  return optimizer;
}

const Optimizer& OptimizerOf(const SimulatorConfig& config) {
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

bool CommitsLayers(const SimulatorConfig& config) {
  return OptimizerOf(config).CommitDoubles(config) > 0;
}

bool StepsLocally(const SimulatorConfig& config) {
  return OptimizerOf(config).StepsLocally();
}

uint64_t StateBytesPerElement(const SimulatorConfig& config) {
  uint64_t bytes = 0;
  for (const StateArray& array : OptimizerOf(config).State(config)) {
    if (array.per_element) bytes += 4;
  }
  return bytes;
}

void FrozenVarianceScalars(const SimulatorConfig& config, ReplyRule& rule) {
  if (config.bias_correction) {
    // v and its correction freeze together: 1 - b2^T_w.
    rule.scalars.bias_correction2 =
        MakeAdamScalars(config.adam, 0.0f, config.freeze_step, true)
            .bias_correction2;
  }
  if (config.bound_update)
    rule.scalars.max_ratio = OneBitUpdateBound(config.adam);
}

}  // namespace morse::compress
