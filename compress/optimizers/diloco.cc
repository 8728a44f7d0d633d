// diloco: DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
// Training of Language Models"), design.md 2.11, with its outer optimizer on
// the shards. Each worker i runs H = sync_every steps of its own inner
// optimizer (any torch optimizer in morse.torch.DiLoCo) from x, then pushes
// its pseudo-gradient; one Morse step is one outer step:
//   worker i pushes C_up(d_i + e_i), d_i = x - x_i (its model after H inner
//   steps); a shard averages in rank order and replies C_down(avg + e_s);
//   every replica then runs, on the decoded average d,
//   m = mu*m + d,  x = x - lr_out * (nesterov ? d + mu*m : m),
// and the workers restart their inner steps from the new x. m is the outer
// momentum; v is not used. The paper's defaults: lr_out 0.7, mu 0.9,
// Nesterov, H = 500. With fp32 both ways, mu = 0 and lr_out = 1, x becomes
// the average of the workers' models (federated averaging).
//
// Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with
// overlapping communication"): with F = fragments > 1, partition q belongs
// to fragment q mod F (strided, so every shard carries a share of every
// step), and step t syncs fragment t mod F alone, every H/F inner steps; the
// other partitions are idle in that step (empty pushes and replies, nothing
// changes). Each fragment thus syncs every H inner steps, F steps apart.
//
// Warmup (warmup_steps K, warmup_sync_every h): the first K outer steps
// come after h inner steps each (h = 1: every inner step syncs, close to
// synchronous training while the model moves fastest), the later ones after
// H / F. Only the workers count inner steps: the shards' rule is unchanged.
//
// Overlap (the 2025 paper's tau; overlap_steps): a worker begins outer step
// t's exchange and takes the first tau inner steps of step t + 1 before it
// waits for the reply; then its synced partitions merge the new outer
// parameters with its own by `mixing` (MergeOuter, diloco.h). Neither
// changes the shards' rule: a worker's pseudo-gradient is always taken
// against the outer parameters of the step before.
#include "compress/optimizers/diloco.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/layout.h"
#include "compress/optimizer.h"
#include "compress/step_plan.h"

namespace morse::compress {
namespace {

class Diloco final : public Optimizer {
 public:
  absl::string_view name() const override { return "diloco"; }
  OptimizerKind kind() const override { return OptimizerKind::kDiloco; }

  absl::Status Validate(const AlgorithmConfig& c) const override {
    const DilocoSpec& d = c.diloco;
    if (d.sync_every < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.sync_every must be at least 1, got ", d.sync_every));
    }
    if (!(d.outer_lr > 0.0f) || !std::isfinite(d.outer_lr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.outer_lr must be positive and finite, got ", d.outer_lr));
    }
    if (!(d.outer_momentum >= 0.0f && d.outer_momentum < 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.outer_momentum must be in [0, 1), got ", d.outer_momentum));
    }
    if (d.fragments < 1 || d.sync_every % d.fragments != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.fragments must be at least 1 and divide sync_every (",
          d.sync_every, "), got ", d.fragments));
    }
    if (d.fragments > 1) {
      const uint32_t partitions = PartitionCount(c.layout);
      if (partitions % d.fragments != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "diloco.fragments (", d.fragments,
            ") must divide the layout's partitions (", partitions,
            "); choose partition_elems or the fragment count so that it "
            "does"));
      }
    }
    const int64_t period = d.sync_every / d.fragments;
    if (d.overlap_steps < 0 || d.overlap_steps >= period) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.overlap_steps must be in [0, sync_every / fragments = ",
          period,
          ") (a reply is applied before the next exchange begins), "
          "got ",
          d.overlap_steps));
    }
    if (d.warmup_steps < 0 || d.warmup_sync_every < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.warmup_steps must be at least 0 and warmup_sync_every at "
          "least 1, got ",
          d.warmup_steps, " and ", d.warmup_sync_every));
    }
    if (d.warmup_steps > 0 && d.overlap_steps >= d.warmup_sync_every) {
      return absl::InvalidArgumentError(absl::StrCat(
          "diloco.overlap_steps (", d.overlap_steps,
          ") must be below warmup_sync_every (", d.warmup_sync_every,
          ") with warmup_steps: a reply is applied before the next exchange "
          "begins"));
    }
    if (!(d.mixing >= 0.0f && d.mixing < 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("diloco.mixing must be in [0, 1), got ", d.mixing));
    }
    if (c.clip_grad_norm != 0.0f) {
      return absl::InvalidArgumentError(
          "clip_grad_norm is not diloco's: the outer step does not clip the "
          "pseudo-gradient; clip in the inner optimizer's steps");
    }
    return absl::OkStatus();
  }

  void Fingerprint(const AlgorithmConfig& c, Fnv64& hash) const override {
    hash.MixInt(static_cast<uint64_t>(c.diloco.sync_every));
    hash.MixWords(&c.diloco.outer_lr, sizeof(float));
    hash.MixWords(&c.diloco.outer_momentum, sizeof(float));
    hash.MixInt(c.diloco.nesterov ? 1 : 0);
    // One fragment mixes nothing: the fingerprints of earlier jobs hold.
    if (c.diloco.fragments > 1)
      hash.MixInt(static_cast<uint64_t>(c.diloco.fragments));
    // The workers' own rule: every worker must apply the same one. Zero
    // mixes nothing, as above.
    if (c.diloco.overlap_steps != 0 || c.diloco.mixing != 0.0f) {
      hash.MixInt(static_cast<uint64_t>(c.diloco.overlap_steps));
      hash.MixWords(&c.diloco.mixing, sizeof(float));
    }
    if (c.diloco.warmup_steps != 0) {  // none mixes nothing, as above
      hash.MixInt(static_cast<uint64_t>(c.diloco.warmup_steps));
      hash.MixInt(static_cast<uint64_t>(c.diloco.warmup_sync_every));
    }
  }

  StepPlan Plan(const AlgorithmConfig& c, int64_t) const override {
    return UnfrozenPlan(c);  // every outer step exchanges
  }

  const char* Phase(const StepPlan&) const override { return "outer"; }

  void PlanReply(const AlgorithmConfig& c, int64_t, const StepPlan&,
                 const StepHyper*, ReplyRule& rule) const override {
    rule.outer = true;
    rule.outer_scalars = {c.diloco.outer_lr, c.diloco.outer_momentum,
                          c.diloco.nesterov};
  }

  int64_t InnerSteps(const AlgorithmConfig& c) const override {
    return c.diloco.sync_every / c.diloco.fragments;
  }

  bool Idle(const AlgorithmConfig& c, int64_t step,
            uint64_t first_index) const override {
    const int64_t fragments = c.diloco.fragments;
    if (fragments <= 1) return false;
    return PartitionIndexAt(c.layout, first_index) % fragments !=
           step % fragments;
  }

  // Nothing is frozen: no mask, no bound.
  bool FreezesVariance() const override { return false; }
  // OuterStep has no CUDA kernel yet: a GPU worker keeps the outer state on
  // the host (morse.torch.DiLoCo does so for any model).
  bool HasGpuKernels() const override { return false; }
};

}  // namespace

void MergeOuter(const AlgorithmConfig& config, const Layout& layout,
                int64_t step, absl::Span<const float> outer,
                absl::Span<float> local) {
  MORSE_CHECK(outer.size() == local.size() &&
              outer.size() == layout.spec().dim);
  if (step < 0) {
    std::copy(outer.begin(), outer.end(), local.begin());
    return;
  }
  const float mixing = config.diloco.mixing;
  const float rest = 1.0f - mixing;
  for (const Partition& p : layout.partitions()) {
    if (Idle(config, step, p.range.begin)) continue;
    if (mixing == 0.0f) {
      std::copy(outer.begin() + p.range.begin, outer.begin() + p.range.end,
                local.begin() + p.range.begin);
      continue;
    }
    for (uint64_t j = p.range.begin; j < p.range.end; ++j)
      local[j] = mixing * local[j] + rest * outer[j];
  }
}

int64_t InnerStepsBefore(const AlgorithmConfig& config, int64_t step) {
  const DilocoSpec& d = config.diloco;
  const int64_t warmup = std::min(step, d.warmup_steps);
  return warmup * d.warmup_sync_every +
         (step - warmup) * (d.sync_every / d.fragments);
}

const Optimizer& DilocoOptimizer() {
  static const Diloco* const optimizer = new Diloco;
  return *optimizer;
}

}  // namespace morse::compress
