// diloco's worker-side rule (design.md 2.11), which its optimizer
// (diloco.cc) defines and every worker reads: morse-worker's inner Adam,
// morse.torch.DiLoCo (through the C ABI) and the tests' simulation.
#ifndef MORSE_COMPRESS_OPTIMIZERS_DILOCO_H_
#define MORSE_COMPRESS_OPTIMIZERS_DILOCO_H_

#include <cstdint>

#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/layout.h"

namespace morse::compress {

// After outer step `step`'s reply: a worker's own parameters `local` of the
// partitions that step synced (all of them without fragments) become the
// outer parameters `outer` (diloco.mixing 0), or
//   local = mixing * local + (1 - mixing) * outer,
// in fp32 with 1 - mixing rounded once; the partitions the step left idle
// keep this worker's progress. Before the first step (`step` < 0) every
// partition takes `outer`, whatever the mixing.
void MergeOuter(const AlgorithmConfig& config, const Layout& layout,
                int64_t step, absl::Span<const float> outer,
                absl::Span<float> local);

// The inner steps a worker takes before outer step `step` (>= 0) begins:
// warmup_sync_every for each of the first warmup_steps outer steps, then
// sync_every / fragments for each later one. Outer step t thus syncs after
// InnerStepsBefore(t + 1) inner steps.
int64_t InnerStepsBefore(const AlgorithmConfig& config, int64_t step);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_OPTIMIZERS_DILOCO_H_
