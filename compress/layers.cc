#include "compress/layers.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/step_rules.h"

namespace morse::compress {
namespace {

// The layer of global element `at`: the last bound <= at.
size_t LayerOf(absl::Span<const uint64_t> bounds, uint64_t at) {
  return static_cast<size_t>(
             std::upper_bound(bounds.begin(), bounds.end(), at) -
             bounds.begin()) -
         1;
}

}  // namespace

std::vector<uint64_t> LayerBounds(const AlgorithmConfig& config) {
  std::vector<uint64_t> bounds{0};
  for (uint64_t size : config.layers) bounds.push_back(bounds.back() + size);
  if (config.layers.empty()) bounds.push_back(config.layout.dim);
  return bounds;
}

size_t LayerCount(const AlgorithmConfig& config) {
  return std::max<size_t>(1, config.layers.size());
}

absl::StatusOr<std::vector<uint32_t>> LayerSegments(
    const AlgorithmConfig& config, absl::string_view name) {
  const std::vector<uint64_t> bounds = LayerBounds(config);
  const std::vector<uint64_t>& cuts = config.layout.cuts;
  for (uint64_t cut : cuts) {
    const size_t l = LayerOf(bounds, cut);
    if (bounds[l] != cut) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, "'s parameter groups (external.groups) must each start on a ",
          "layer; the group at element ", cut, " starts inside layer ", l, " [",
          bounds[l], ", ", bounds[l + 1], ")"));
    }
  }
  std::vector<uint32_t> segments;
  for (size_t l = 0; l + 1 < bounds.size(); ++l) {
    segments.push_back(static_cast<uint32_t>(
        std::upper_bound(cuts.begin(), cuts.end(), bounds[l]) - cuts.begin()));
  }
  return segments;
}

std::vector<LayerPiece> LayerPiecesOf(const AlgorithmConfig& config,
                                      Range partition) {
  const std::vector<uint64_t> bounds = LayerBounds(config);
  std::vector<LayerPiece> pieces;
  for (uint64_t at = partition.begin; at < partition.end;) {
    const size_t l = LayerOf(bounds, at);
    const uint64_t end = std::min(partition.end, bounds[l + 1]);
    pieces.push_back({at, end, static_cast<uint32_t>(l)});
    at = end;
  }
  return pieces;
}

std::vector<LayerPiece> LayerPieces(const AlgorithmConfig& config,
                                    const Layout& layout, Range range) {
  std::vector<LayerPiece> pieces;
  for (const Partition& p : layout.partitions()) {
    if (p.range.begin < range.begin || p.range.end > range.end) continue;
    const std::vector<LayerPiece> of = LayerPiecesOf(config, p.range);
    pieces.insert(pieces.end(), of.begin(), of.end());
  }
  return pieces;
}

std::vector<double> SegmentStatsOf(const LayerRule& layers,
                                   const ReplyRule& rule,
                                   absl::Span<const LayerPiece> pieces,
                                   Range held, absl::Span<const float> x,
                                   absl::Span<const float> m,
                                   absl::Span<const float> v,
                                   absl::Span<const float> fresh) {
  MORSE_CHECK(x.size() == held.size() && m.size() == x.size() &&
              v.size() == x.size() && fresh.size() == x.size());
  const int k = layers.stats();
  std::vector<double> segments;
  std::vector<double> out(k);
  for (const LayerPiece& piece : pieces) {
    MORSE_CHECK(piece.begin >= held.begin && piece.end <= held.end);
    for (uint64_t at = piece.begin; at < piece.end; at += kLayerSegment) {
      const size_t j = at - held.begin;
      layers.SegmentStats(rule, &x[j], &m[j], &v[j], &fresh[j],
                          std::min(kLayerSegment, piece.end - at), out.data());
      segments.insert(segments.end(), out.begin(), out.end());
    }
  }
  return segments;
}

std::vector<double> PieceStats(const LayerRule& layers,
                               absl::Span<const LayerPiece> pieces,
                               absl::Span<const double> segments) {
  const size_t k = layers.stats();
  std::vector<double> stats(k * pieces.size(), 0.0);
  size_t s = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (uint64_t n = 0; n < pieces[i].segments(); ++n, ++s) {
      MORSE_CHECK(k * (s + 1) <= segments.size());
      layers.Add(&segments[k * s], &stats[k * i]);
    }
  }
  MORSE_CHECK(k * s == segments.size());
  return stats;
}

std::vector<double> LayerTotals(const AlgorithmConfig& config,
                                const LayerRule& layers,
                                absl::Span<const LayerPiece> pieces,
                                absl::Span<const double> piece_stats) {
  const size_t k = layers.stats();
  MORSE_CHECK(piece_stats.size() == k * pieces.size());
  std::vector<double> totals(k * LayerCount(config), 0.0);
  for (size_t i = 0; i < pieces.size(); ++i)
    layers.Add(&piece_stats[k * i], &totals[k * pieces[i].layer]);
  return totals;
}

std::vector<double> LayerTotalsOf(const AlgorithmConfig& config,
                                  const LayerRule& layers, const Layout& layout,
                                  absl::Span<const ReplyRule> rules,
                                  Range range, absl::Span<const float> x,
                                  absl::Span<const float> m,
                                  absl::Span<const float> v,
                                  absl::Span<const float> fresh) {
  std::vector<LayerPiece> pieces;
  std::vector<double> stats;
  for (const Partition& p : layout.partitions()) {
    if (p.range.begin < range.begin || p.range.end > range.end) continue;
    const std::vector<LayerPiece> of = LayerPiecesOf(config, p.range);
    const std::vector<double> these =
        PieceStats(layers, of,
                   SegmentStatsOf(layers, RuleOf(rules, p.segment), of, range,
                                  x, m, v, fresh));
    pieces.insert(pieces.end(), of.begin(), of.end());
    stats.insert(stats.end(), these.begin(), these.end());
  }
  return LayerTotals(config, layers, pieces, stats);
}

std::vector<double> LayerCommit(const AlgorithmConfig& config,
                                const LayerRule& layers,
                                absl::Span<const ReplyRule> rules,
                                absl::Span<const double> totals,
                                absl::Span<const float> state) {
  const size_t count = LayerCount(config);
  MORSE_CHECK(totals.size() == layers.stats() * count);
  // Validated with the config (the optimizer's Validate).
  const absl::StatusOr<std::vector<uint32_t>> segment =
      LayerSegments(config, "");
  MORSE_CHECK(segment.ok() && segment->size() == count);
  const size_t c = layers.commit_values();
  std::vector<double> commit(c * count);
  for (size_t l = 0; l < count; ++l) {
    layers.Commit(config, RuleOf(rules, (*segment)[l]),
                  &totals[layers.stats() * l], l, state, &commit[c * l]);
  }
  return commit;
}

absl::Status ValidateCommitOfLayers(const AlgorithmConfig& config,
                                    const LayerRule& layers,
                                    absl::Span<const double> commit) {
  const size_t count = LayerCount(config);
  const size_t c = layers.commit_values();
  if (commit.size() != c * count) {
    return absl::InvalidArgumentError(
        absl::StrCat("a commit has ", c, " values for each of the model's ",
                     count, " layers, got ", commit.size()));
  }
  for (size_t l = 0; l < count; ++l) {
    if (absl::Status s = layers.ValidateLayer(l, commit.subspan(c * l, c));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void MoveLayersX(const AlgorithmConfig& config, const LayerRule& layers,
                 const ReplyRule& rule, absl::Span<const double> commit,
                 Range range, uint64_t begin, uint64_t n, absl::Span<float> x,
                 absl::Span<const float> m, absl::Span<const float> v) {
  MORSE_CHECK(begin >= range.begin && begin + n <= range.end &&
              x.size() == range.size() && m.size() == x.size() &&
              v.size() == x.size());
  const std::vector<uint64_t> bounds = LayerBounds(config);
  const size_t c = layers.commit_values();
  MORSE_CHECK(commit.size() == c * (bounds.size() - 1));
  for (uint64_t at = begin; at < begin + n;) {
    const size_t l = LayerOf(bounds, at);
    const uint64_t end = std::min(begin + n, bounds[l + 1]);
    const size_t j = at - range.begin;
    layers.MoveX(rule, &commit[c * l], &x[j], &m[j], &v[j], end - at);
    at = end;
  }
}

}  // namespace morse::compress
