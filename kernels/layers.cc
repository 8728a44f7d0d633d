#include "kernels/layers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "compress/lamb.h"
#include "compress/optimizer.h"
#include "kernels/codecs.h"

namespace morse::kernels {
namespace {

// onebit_lamb's: its segments' and pieces' sums, and x moved by each
// layer's step lr * c_l (compress::LambLayerSteps).
class LambLayerKernels final : public LayerKernels {
 public:
  explicit LambLayerKernels(LambSegments segments)
      : segments_(std::move(segments)) {}

  absl::StatusOr<absl::Span<const double>> PieceStats(
      Context& ctx, const compress::ReplyRule& rule, const float* x,
      const float* m, const float* v, const float* fresh) override {
    return segments_.PieceSums(ctx, rule, x, m, v, fresh);
  }

  absl::Status MoveX(Context& ctx, const compress::ReplyRule& rule,
                     absl::Span<const double> commit, float* x, const float* m,
                     const float* v) override {
    return segments_.UpdateX(ctx, rule, compress::LambLayerSteps(rule, commit),
                             x, m, v);
  }

 private:
  LambSegments segments_;
};

absl::StatusOr<std::unique_ptr<LayerKernels>> MakeLamb(
    const compress::AlgorithmConfig& config,
    absl::Span<const compress::LayerPiece> pieces) {
  absl::StatusOr<LambSegments> segments =
      LambSegments::Create(pieces, compress::LayerCount(config));
  if (!segments.ok()) return segments.status();
  return std::make_unique<LambLayerKernels>(*std::move(segments));
}

// Every optimizer whose layer rule has GPU kernels, by its kind.
struct Entry {
  compress::OptimizerKind kind;
  absl::StatusOr<std::unique_ptr<LayerKernels>> (*make)(
      const compress::AlgorithmConfig& config,
      absl::Span<const compress::LayerPiece> pieces);
};
constexpr Entry kLayerKernels[] = {
    {compress::OptimizerKind::kOneBitLamb, &MakeLamb},
};

const Entry* EntryOf(const compress::AlgorithmConfig& config) {
  if (compress::OptimizerOf(config).Layers() == nullptr) return nullptr;
  for (const Entry& entry : kLayerKernels) {
    if (entry.kind == config.optimizer) return &entry;
  }
  return nullptr;
}

}  // namespace

bool HasLayerKernels(const compress::AlgorithmConfig& config) {
  return EntryOf(config) != nullptr;
}

absl::StatusOr<std::unique_ptr<LayerKernels>> LayerKernelsFor(
    const compress::AlgorithmConfig& config,
    absl::Span<const compress::LayerPiece> pieces) {
  const Entry* entry = EntryOf(config);
  if (entry == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat(compress::OptimizerOf(config).name(),
                     " has no GPU kernels for its layer rule"));
  }
  return entry->make(config, pieces);
}

}  // namespace morse::kernels
