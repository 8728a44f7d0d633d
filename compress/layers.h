// Layer rules: steps that move each layer (parameter tensor) of the model by
// a factor from statistics over the whole layer, which may span partitions
// and shards (onebit_lamb's trust ratios, design.md 2.8). An optimizer with
// one (Optimizer::Layers) applies a step in two halves. Its reply rule moves
// m, v and its own per-element array; then each layer's statistics, summed
// over the whole model in partition order, give the step's commit (a few
// doubles per layer: the layer's factor and its state after the step), and
// the commit moves x. A worker holds the whole model and forms the commit
// itself; a shard's mirror holds one range, so rank 0 sends it the commit
// (ShardCore::Commit).
//
// What is here is the same for every layer rule: the layers and their
// pieces, the order of the sums, the commit's shape and the walk of x by
// layer. The LayerRule says what is summed, how two statistics combine, what
// a layer's totals commit to and how the commit moves x. Sums are in double
// in a fixed order, so every replica, and a GPU following it, has the same
// bits:
//   a layer's total adds its pieces (its part in one partition) in partition
//   order; a piece adds its segments (kLayerSegment elements from the
//   piece's start, the last one shorter) in order; a segment's statistics
//   are the rule's own (SegmentStats), each from a fixed tree.
#ifndef MORSE_COMPRESS_LAYERS_H_
#define MORSE_COMPRESS_LAYERS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/halving_sum.h"
#include "compress/layout.h"

namespace morse::compress {

struct ReplyRule;

// The first element of every layer, then D (config.layers, or one layer).
std::vector<uint64_t> LayerBounds(const AlgorithmConfig& config);
// How many layers: config.layers.size(), or 1.
size_t LayerCount(const AlgorithmConfig& config);
// The segment of the layout (parameter group) that holds each layer.
// INVALID_ARGUMENT unless every segment starts on a layer (a layer in two
// groups would take two learning rates); `name` is the optimizer's.
absl::StatusOr<std::vector<uint32_t>> LayerSegments(
    const AlgorithmConfig& config, absl::string_view name);

inline constexpr uint64_t kLayerSegment = kSumSegment;

// One layer's part in one partition: global elements [begin, end).
struct LayerPiece {
  uint64_t begin = 0, end = 0;
  uint32_t layer = 0;
  uint64_t segments() const {
    return (end - begin + kLayerSegment - 1) / kLayerSegment;
  }
};
// The pieces of one partition's range: the range cut at the layer bounds.
std::vector<LayerPiece> LayerPiecesOf(const AlgorithmConfig& config,
                                      Range partition);
// The pieces of the partitions of `layout` inside `range`, in partition
// order, then element order.
std::vector<LayerPiece> LayerPieces(const AlgorithmConfig& config,
                                    const Layout& layout, Range range);

// An optimizer's rule over layers. Its arrays: x, m, v and the optimizer's
// per-element state array (`fresh`: onebit_lamb's v'), and its layer state
// array (floats per layer, Optimizer::State's array that is not per
// element).
class LayerRule {
 public:
  virtual ~LayerRule() = default;
  // Doubles of statistics per segment, piece and layer.
  virtual int stats() const = 0;
  // Doubles per layer in a commit.
  virtual int commit_values() const = 0;
  // One segment's statistics (stats() values) from its n <= kLayerSegment
  // elements, after the reply of `rule`.
  virtual void SegmentStats(const ReplyRule& rule, const float* x,
                            const float* m, const float* v, const float* fresh,
                            uint64_t n, double* out) const = 0;
  // total = total + part, each statistic its own way (a sum, a maximum);
  // totals start at +0.
  virtual void Add(const double* part, double* total) const = 0;
  // Layer `layer`'s commit (commit_values() values) from its totals, the
  // layers' state before the step and its segment's rule.
  virtual void Commit(const AlgorithmConfig& config, const ReplyRule& rule,
                      const double* totals, size_t layer,
                      absl::Span<const float> state, double* out) const = 0;
  // OK or INVALID_ARGUMENT: layer `layer`'s commit values as no worker
  // could send them.
  virtual absl::Status ValidateLayer(size_t layer,
                                     absl::Span<const double> values) const = 0;
  // Moves x over n elements of one layer by its commit values.
  virtual void MoveX(const ReplyRule& rule, const double* commit, float* x,
                     const float* m, const float* v, uint64_t n) const = 0;
};

// The statistics of every segment of `pieces`, in order; the arrays hold
// `held`, which holds the pieces.
std::vector<double> SegmentStatsOf(const LayerRule& layers,
                                   const ReplyRule& rule,
                                   absl::Span<const LayerPiece> pieces,
                                   Range held, absl::Span<const float> x,
                                   absl::Span<const float> m,
                                   absl::Span<const float> v,
                                   absl::Span<const float> fresh);
// Each piece's statistics from its segments' (SegmentStatsOf), each piece's
// added in order from +0. A shard sends these with each reply (PushReply
// `piece_stats`), computed on its mirror, so that workers add them alone.
std::vector<double> PieceStats(const LayerRule& layers,
                               absl::Span<const LayerPiece> pieces,
                               absl::Span<const double> segments);
// Each layer's totals from every piece's statistics (pieces in the order of
// LayerPieces), each piece added to its layer's total in order.
std::vector<double> LayerTotals(const AlgorithmConfig& config,
                                const LayerRule& layers,
                                absl::Span<const LayerPiece> pieces,
                                absl::Span<const double> piece_stats);
// LayerTotals of the partitions of `layout` inside `range` (all of them for
// a worker) from the arrays over `range`, each partition taking its
// segment's rule among `rules` (PlanReplies).
std::vector<double> LayerTotalsOf(const AlgorithmConfig& config,
                                  const LayerRule& layers, const Layout& layout,
                                  absl::Span<const ReplyRule> rules,
                                  Range range, absl::Span<const float> x,
                                  absl::Span<const float> m,
                                  absl::Span<const float> v,
                                  absl::Span<const float> fresh);

// The step's commit from its totals and the layers' state before it; each
// layer takes the rule of its segment among `rules`.
std::vector<double> LayerCommit(const AlgorithmConfig& config,
                                const LayerRule& layers,
                                absl::Span<const ReplyRule> rules,
                                absl::Span<const double> totals,
                                absl::Span<const float> state);
// INVALID_ARGUMENT unless `commit` has commit_values() per layer that the
// rule accepts.
absl::Status ValidateCommitOfLayers(const AlgorithmConfig& config,
                                    const LayerRule& layers,
                                    absl::Span<const double> commit);

// Moves x by `commit` over global elements [begin, begin + n), each layer
// by its own values; the arrays hold `range`.
void MoveLayersX(const AlgorithmConfig& config, const LayerRule& layers,
                 const ReplyRule& rule, absl::Span<const double> commit,
                 Range range, uint64_t begin, uint64_t n, absl::Span<float> x,
                 absl::Span<const float> m, absl::Span<const float> v);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_LAYERS_H_
