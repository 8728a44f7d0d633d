// compress/layers.h on its own: what every layer rule shares (the layers,
// their pieces, the order of the sums, the commit's shape, x moved layer by
// layer), checked with a rule of this test's own, so that a second
// optimizer with a layer rule can rely on it without onebit_lamb.
#include "compress/layers.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "compress/algorithm.h"
#include "compress/layout.h"
#include "compress/step_plan.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

// Statistics [count, sum of x, max of m] per segment; a layer commits one
// value, its rule's lr times the mean of x; MoveX subtracts it from x.
// Every statistic is an integer below 2^53, so sums in any order agree and
// the test can say which order it expects by the counts alone.
class MeanRule final : public LayerRule {
 public:
  int stats() const override { return 3; }
  int commit_values() const override { return 1; }

  void SegmentStats(const ReplyRule&, const float* x, const float* m,
                    const float*, const float*, uint64_t n,
                    double* out) const override {
    ++segments_seen;
    EXPECT_LE(n, kLayerSegment);
    out[0] = static_cast<double>(n);
    out[1] = 0;
    out[2] = 0;
    for (uint64_t j = 0; j < n; ++j) {
      out[1] += x[j];
      out[2] = m[j] > out[2] ? m[j] : out[2];
    }
  }

  void Add(const double* part, double* total) const override {
    total[0] += part[0];
    total[1] += part[1];
    total[2] = part[2] > total[2] ? part[2] : total[2];
  }

  void Commit(const AlgorithmConfig&, const ReplyRule& rule,
              const double* totals, size_t layer, absl::Span<const float> state,
              double* out) const override {
    out[0] = rule.scalars.lr * (totals[1] / totals[0]) + state[layer];
  }

  absl::Status ValidateLayer(size_t layer,
                             absl::Span<const double> values) const override {
    if (values[0] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " commits ", values[0]));
    }
    return absl::OkStatus();
  }

  void MoveX(const ReplyRule&, const double* commit, float* x, const float*,
             const float*, uint64_t n) const override {
    for (uint64_t j = 0; j < n; ++j) x[j] -= static_cast<float>(commit[0]);
  }

  mutable int segments_seen = 0;
};

// 1000 elements in partitions of 384 over two shards; layers of 10, 250,
// 600 (across partitions and shards), 64 and 76 elements.
AlgorithmConfig Config() {
  AlgorithmConfig c;
  c.layout = {1000, /*shards=*/2, /*block_elems=*/64, /*partition_elems=*/384};
  c.layers = {10, 250, 600, 64, 76};
  return c;
}

TEST(LayersTest, PiecesCutPartitionsAtTheLayerBounds) {
  const AlgorithmConfig c = Config();
  EXPECT_EQ(LayerCount(c), 5u);
  EXPECT_EQ(LayerBounds(c),
            (std::vector<uint64_t>{0, 10, 260, 860, 924, 1000}));
  const std::vector<LayerPiece> of = LayerPiecesOf(c, {384, 768});
  ASSERT_EQ(of.size(), 1u);  // inside layer 2
  EXPECT_EQ(of[0].layer, 2u);
  EXPECT_EQ(of[0].segments(), 2u);  // 256 + 128
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Every partition cut at the layer bounds, in partition order: the
  // pieces tile the model, each inside one layer and one partition.
  const std::vector<LayerPiece> all = LayerPieces(c, *layout, {0, 1000});
  const std::vector<uint64_t> bounds = LayerBounds(c);
  uint64_t at = 0;
  for (const LayerPiece& piece : all) {
    EXPECT_EQ(piece.begin, at);
    EXPECT_LT(piece.begin, piece.end);
    EXPECT_GE(piece.begin, bounds[piece.layer]);
    EXPECT_LE(piece.end, bounds[piece.layer + 1]);
    bool in_one = false;
    for (const Partition& p : layout->partitions())
      in_one |= p.range.begin <= piece.begin && piece.end <= p.range.end;
    EXPECT_TRUE(in_one) << piece.begin;
    at = piece.end;
  }
  EXPECT_EQ(at, 1000u);
  EXPECT_GT(all.size(), layout->partitions().size());
  // A config without layers is one layer.
  AlgorithmConfig one = c;
  one.layers.clear();
  EXPECT_EQ(LayerCount(one), 1u);
  EXPECT_EQ(LayerBounds(one), (std::vector<uint64_t>{0, 1000}));
}

TEST(LayersTest, TotalsAddEveryPieceOfALayerWhereverItLies) {
  const AlgorithmConfig c = Config();
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  std::vector<float> x(1000), m(1000), v(1000, 0.0f), fresh(1000, 0.0f);
  for (size_t j = 0; j < x.size(); ++j) {
    x[j] = static_cast<float>(j % 7);
    m[j] = static_cast<float>(j % 301);
  }
  MeanRule rule;
  ReplyRule reply;
  const std::vector<double> totals =
      LayerTotalsOf(c, rule, *layout, {reply}, {0, 1000}, x, m, v, fresh);
  ASSERT_EQ(totals.size(), 3u * 5);
  const std::vector<uint64_t> bounds = LayerBounds(c);
  for (size_t l = 0; l < 5; ++l) {
    double sum = 0, most = 0;
    for (uint64_t j = bounds[l]; j < bounds[l + 1]; ++j) {
      sum += x[j];
      most = m[j] > most ? m[j] : most;
    }
    EXPECT_EQ(totals[3 * l], static_cast<double>(bounds[l + 1] - bounds[l]))
        << l;
    EXPECT_EQ(totals[3 * l + 1], sum) << l;
    EXPECT_EQ(totals[3 * l + 2], most) << l;
  }
  // Segments of kLayerSegment elements from each piece's start.
  const std::vector<LayerPiece> pieces = LayerPieces(c, *layout, {0, 1000});
  int expected_segments = 0;
  for (const LayerPiece& piece : pieces)
    expected_segments += static_cast<int>(piece.segments());
  EXPECT_EQ(rule.segments_seen, expected_segments);
  EXPECT_GT(expected_segments, static_cast<int>(pieces.size()));

  // The same totals from each piece's statistics, as a shard sends them.
  std::vector<double> stats;
  for (const Partition& p : layout->partitions()) {
    const std::vector<LayerPiece> of = LayerPiecesOf(c, p.range);
    const std::vector<double> segments = SegmentStatsOf(
        rule, reply, of, p.range,
        absl::MakeConstSpan(x).subspan(p.range.begin, p.range.size()),
        absl::MakeConstSpan(m).subspan(p.range.begin, p.range.size()),
        absl::MakeConstSpan(v).subspan(p.range.begin, p.range.size()),
        absl::MakeConstSpan(fresh).subspan(p.range.begin, p.range.size()));
    const std::vector<double> these = PieceStats(rule, of, segments);
    ASSERT_EQ(these.size(), 3 * of.size());
    stats.insert(stats.end(), these.begin(), these.end());
  }
  EXPECT_EQ(LayerTotals(c, rule, pieces, stats), totals);
}

TEST(LayersTest, EachLayerCommitsWithItsGroupsRuleAndMovesByItsOwnValue) {
  AlgorithmConfig c = Config();
  c.layout.cuts = {256};  // no: inside layer 1
  auto segments = LayerSegments(c, "toy");
  ASSERT_EQ(segments.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(segments.status().message().find("toy's parameter groups"),
            std::string::npos)
      << segments.status();
  c.layers = {10, 246, 604, 64, 76};  // groups at 0 and 256: layers 0-1, 2-4
  segments = LayerSegments(c, "toy");
  ASSERT_TRUE(segments.ok()) << segments.status();
  EXPECT_EQ(*segments, (std::vector<uint32_t>{0, 0, 1, 1, 1}));

  MeanRule rule;
  std::vector<ReplyRule> rules(2);
  rules[0].scalars.lr = 1.0f;
  rules[1].scalars.lr = 2.0f;
  // Totals [count, sum, max]: means 1, 2, 3, 4, 5.
  std::vector<double> totals;
  for (int l = 0; l < 5; ++l)
    totals.insert(totals.end(), {2.0, 2.0 * (l + 1), 0});
  const std::vector<float> state = {0, 0, 0, 0, 100};
  const std::vector<double> commit = LayerCommit(c, rule, rules, totals, state);
  EXPECT_EQ(commit, (std::vector<double>{1, 2, 6, 8, 110}));
  EXPECT_TRUE(ValidateCommitOfLayers(c, rule, commit).ok());

  // x over [250, 870): the end of layer 1, all of layer 2, part of layer 3.
  std::vector<float> x(620, 100.0f), m(620), v(620);
  MoveLayersX(c, rule, rules[0], commit, {250, 870}, 250, 620,
              absl::MakeSpan(x), m, v);
  for (size_t j = 0; j < x.size(); ++j) {
    const uint64_t at = 250 + j;
    const float expected = at < 256 ? 98.0f : at < 860 ? 94.0f : 92.0f;
    ASSERT_EQ(x[j], expected) << at;
  }
}

TEST(LayersTest, ACommitOfTheWrongShapeOrAValueTheRuleRefusesIsInvalid) {
  const AlgorithmConfig c = Config();
  MeanRule rule;
  absl::Status s = ValidateCommitOfLayers(c, rule, {1, 2, 3});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("1 values for each of the model's 5 layers, "
                             "got 3"),
            std::string::npos)
      << s;
  s = ValidateCommitOfLayers(c, rule, {1, 2, -3, 4, 5});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer 2 commits -3"), std::string::npos) << s;
}

}  // namespace
}  // namespace morse::compress
