#include "compress/step_plan.h"

#include <algorithm>

#include "compress/optimizer.h"

namespace morse::compress {

StepPlan PlanStep(const AlgorithmConfig& config, int64_t step) {
  return OptimizerOf(config).Plan(config, step);
}

const char* PhaseName(const AlgorithmConfig& config, int64_t step) {
  return OptimizerOf(config).Phase(PlanStep(config, step));
}

int64_t NextExchange(const AlgorithmConfig& config, int64_t step) {
  return OptimizerOf(config).NextExchange(config, step);
}

bool TakesChangedX(const AlgorithmConfig& config, int64_t step) {
  return NextExchange(config, step) == step ||
         (step > 0 && NextExchange(config, step - 1) == step - 1);
}

bool Idle(const AlgorithmConfig& config, int64_t step, uint64_t first_index) {
  return OptimizerOf(config).Idle(config, step, first_index);
}

SendRule PlanSend(const AlgorithmConfig& config, int64_t step,
                  Direction direction, uint32_t sender, uint64_t first_index,
                  const StepHyper* hyper) {
  const StepPlan plan = PlanStep(config, step);
  SendRule rule;
  rule.codec = direction == Direction::kUp ? plan.up : plan.down;
  rule.local_momentum =
      direction == Direction::kUp && plan.compressing && !plan.local;
  rule.accumulated = direction == Direction::kUp && plan.local;
  rule.step = step;
  rule.beta1 = StepAdamHyper(config, hyper).beta1;
  rule.feedback = plan.feedback;
  rule.mask = plan.compressing && config.mask_zero_variance;
  rule.key = SenderKey(config, step, sender, first_index);
  rule.idle = Idle(config, step, first_index);
  OptimizerOf(config).PlanSend(config, step, plan, hyper, rule);
  return rule;
}

bool ClipsAverage(const AlgorithmConfig& config, int64_t step) {
  return config.clip_grad_norm > 0.0f && !PlanStep(config, step).compressing;
}

bool ClipsLocally(const AlgorithmConfig& config, int64_t step) {
  return config.clip_grad_norm > 0.0f && PlanStep(config, step).compressing;
}

ReplyRule PlanReply(const AlgorithmConfig& config, int64_t step,
                    const StepHyper* hyper, float grad_scale) {
  const StepPlan plan = PlanStep(config, step);
  ReplyRule rule;
  rule.grad_scale = grad_scale;
  rule.codec = plan.down;
  rule.frozen_variance = plan.compressing && !plan.local;
  rule.sync = plan.local;
  rule.mask = plan.compressing && config.mask_zero_variance;
  rule.scalars = StepScalars(config, step, hyper, config.bias_correction);
  OptimizerOf(config).PlanReply(config, step, plan, hyper, rule);
  return rule;
}

std::vector<ReplyRule> PlanReplies(const AlgorithmConfig& config, int64_t step,
                                   absl::Span<const StepHyper> hypers,
                                   float grad_scale) {
  std::vector<ReplyRule> rules;
  for (uint32_t s = 0; s < std::max<size_t>(1, hypers.size()); ++s)
    rules.push_back(PlanReply(config, step, HyperOf(hypers, s), grad_scale));
  return rules;
}

}  // namespace morse::compress
