// The GPU's half of a layer rule (compress/layers.h): the statistics of
// every segment and piece of a parameter group, and x moved by the step's
// commit. The rest of a layer rule (the layers' totals in partition order,
// the commit, its validation, the state after it) stays on the host,
// written once in compress/layers.cc for every rule and every engine.
//
// Each optimizer with a layer rule and GPU kernels gives a LayerKernels in
// kernels/ and one line in layers.cc's list; the CUDA engine holds one per
// parameter group and names no optimizer. An optimizer with a layer rule
// and no entry there trains on the CPU (LayerKernelsFor: UNIMPLEMENTED).
#ifndef MORSE_KERNELS_LAYERS_H_
#define MORSE_KERNELS_LAYERS_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/layers.h"
#include "compress/step_rules.h"
#include "kernels/device.h"

namespace morse::kernels {

// One parameter group's pieces (compress::LayerPieces, in partition order)
// on the GPU. Every pointer is device memory.
class LayerKernels {
 public:
  virtual ~LayerKernels() = default;

  // compress::PieceStats(compress::SegmentStatsOf(...)) of every piece, the
  // rule's stats() values each, in the CPU's order and with its bits; only
  // the pieces' come to the host. Waits for the stream. The span stays valid
  // until the next call.
  virtual absl::StatusOr<absl::Span<const double>> PieceStats(
      Context& ctx, const compress::ReplyRule& rule, const float* x,
      const float* m, const float* v, const float* fresh) = 0;

  // compress::MoveLayersX over the group's pieces: each layer's x moved by
  // its values in `commit` (the whole step's commit, commit_values() per
  // layer of the model). Waits for the stream.
  virtual absl::Status MoveX(Context& ctx, const compress::ReplyRule& rule,
                             absl::Span<const double> commit, float* x,
                             const float* m, const float* v) = 0;
};

// Whether the optimizer of `config` has a layer rule with GPU kernels (false
// without a layer rule).
bool HasLayerKernels(const compress::AlgorithmConfig& config);

// The layer kernels of the optimizer of `config` over `pieces`, one
// parameter group's. UNIMPLEMENTED where it has none (HasLayerKernels).
absl::StatusOr<std::unique_ptr<LayerKernels>> LayerKernelsFor(
    const compress::AlgorithmConfig& config,
    absl::Span<const compress::LayerPiece> pieces);

}  // namespace morse::kernels

#endif  // MORSE_KERNELS_LAYERS_H_
