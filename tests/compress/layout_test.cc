#include "compress/layout.h"

#include <set>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace morse::compress {
namespace {

class LayoutSweep : public ::testing::TestWithParam<
                        std::tuple<uint64_t, uint32_t, uint32_t, uint32_t>> {};

TEST_P(LayoutSweep, PartitionsCoverEverythingOnceAndShardsAreBalanced) {
  const auto [dim, shards, block, partition] = GetParam();
  auto layout = Layout::Create({dim, shards, block, partition});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->block_count(), (dim + block - 1) / block);
  uint64_t next = 0;
  uint32_t id = 0;
  for (const Partition& p : layout->partitions()) {
    EXPECT_EQ(p.id, id++);
    EXPECT_EQ(p.range.begin, next) << "gap or overlap at partition " << p.id;
    EXPECT_GT(p.range.size(), 0u);
    EXPECT_LE(p.range.size(), partition);
    EXPECT_EQ(p.range.begin % block, 0u);
    const Range& shard = layout->shard_range(p.shard);
    EXPECT_GE(p.range.begin, shard.begin);
    EXPECT_LE(p.range.end, shard.end);
    next = p.range.end;
  }
  EXPECT_EQ(next, dim);
  uint64_t min_blocks = UINT64_MAX, max_blocks = 0, covered = 0;
  for (uint32_t s = 0; s < shards; ++s) {
    const Range& r = layout->shard_range(s);
    EXPECT_EQ(r.begin, covered);
    covered = r.end;
    const uint64_t blocks = (r.size() + block - 1) / block;
    min_blocks = std::min(min_blocks, blocks);
    max_blocks = std::max(max_blocks, blocks);
    uint64_t sum = 0;
    for (const Partition& p : layout->shard_partitions(s)) {
      EXPECT_EQ(p.shard, s);
      sum += p.range.size();
    }
    EXPECT_EQ(sum, r.size());
  }
  EXPECT_EQ(covered, dim);
  EXPECT_LE(max_blocks - min_blocks, 1u);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayoutSweep,
    ::testing::Values(std::make_tuple(1, 1, 16, 16),
                      std::make_tuple(17, 2, 16, 16),
                      std::make_tuple(1000003, 3, 2048, 1 << 16),
                      std::make_tuple(25'000'000, 2, 2048, 1 << 20),
                      std::make_tuple(4096, 4, 1024, 1024),
                      std::make_tuple(100'001, 7, 64, 640)));

TEST(LayoutTest, FingerprintIsAFunctionOfTheSpec) {
  const LayoutSpec spec{1000003, 3, 2048, 1 << 16};
  EXPECT_EQ(Layout::Create(spec)->fingerprint(),
            Layout::Create(spec)->fingerprint());
  std::set<uint64_t> seen = {Layout::Create(spec)->fingerprint()};
  for (LayoutSpec other : {LayoutSpec{1000004, 3, 2048, 1 << 16},
                           LayoutSpec{1000003, 2, 2048, 1 << 16},
                           LayoutSpec{1000003, 3, 1024, 1 << 16},
                           LayoutSpec{1000003, 3, 2048, 1 << 17}}) {
    EXPECT_TRUE(seen.insert(Layout::Create(other)->fingerprint()).second);
  }
  // The value is pinned: a change here breaks every deployed peer. (This is
  // the quickstart's layout: D = 4810, 2 shards, 1024-element blocks.)
  EXPECT_EQ(Layout::Create({4810, 2, 1024, 1024})->fingerprint(),
            0x37583bbf38f85f6aull);
}

TEST(LayoutTest, BadSpecsAreRejected) {
  for (LayoutSpec bad :
       {LayoutSpec{0, 1, 16, 16}, LayoutSpec{kMaxDim + 1, 1, 1 << 16, 1 << 30},
        LayoutSpec{UINT64_MAX, 1, 16, 16}, LayoutSpec{100, 0, 16, 16},
        LayoutSpec{100, 1, 24, 48}, LayoutSpec{100, 1, 16, 24},
        LayoutSpec{100, 8, 16, 16} /* 7 blocks, 8 shards */}) {
    EXPECT_EQ(Layout::Create(bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(LayoutTest, CutsEndPartitionsAndNumberTheSegments) {
  // D = 1000, 2 shards of 512 and 488 elements (16-element blocks), runs of
  // 128; parameter groups end at 304, 320, 496 and 704: segment 3 spans the
  // shards' boundary, which ends a partition too.
  const LayoutSpec spec{1000, 2, 16, 128, {304, 320, 496, 704}};
  auto layout = Layout::Create(spec);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->segment_count(), 5u);
  std::vector<std::tuple<uint64_t, uint64_t, uint32_t>> got;
  for (const Partition& p : layout->partitions())
    got.emplace_back(p.range.begin, p.range.end, p.segment);
  const std::vector<std::tuple<uint64_t, uint64_t, uint32_t>> want = {
      {0, 128, 0},   {128, 256, 0}, {256, 304, 0}, {304, 320, 1},
      {320, 448, 2}, {448, 496, 2}, {496, 512, 3}, {512, 640, 3},
      {640, 704, 3}, {704, 832, 4}, {832, 960, 4}, {960, 1000, 4}};
  EXPECT_EQ(got, want);
  EXPECT_EQ(layout->shard_partitions(1).front().range.begin, 512u);
  EXPECT_EQ(PartitionCount(spec), want.size());
  for (const Partition& p : layout->partitions()) {
    EXPECT_EQ(PartitionIndexAt(spec, p.range.begin), p.id);
    EXPECT_EQ(PartitionIndexAt(spec, p.range.end - 1), p.id);
  }
  // Cuts change the fingerprint; none leaves it as it was.
  LayoutSpec plain = spec;
  plain.cuts.clear();
  EXPECT_NE(layout->fingerprint(), Layout::Create(plain)->fingerprint());
  LayoutSpec fewer = spec;
  fewer.cuts.pop_back();
  EXPECT_NE(layout->fingerprint(), Layout::Create(fewer)->fingerprint());
  EXPECT_EQ(Layout::Create(plain)->segment_count(), 1u);
}

TEST(LayoutTest, CutsOutOfOrderOffABlockOrOutsideTheModelAreRejected) {
  for (const std::vector<uint64_t>& cuts : std::vector<std::vector<uint64_t>>{
           {0}, {1008}, {5008}, {304, 304}, {400, 304}, {301}}) {
    const absl::StatusOr<Layout> layout =
        Layout::Create(LayoutSpec{1000, 2, 16, 128, cuts});
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(layout.status().message().find("cut"), std::string::npos);
  }
}

// A layout of more than kMaxPartitions partitions is refused before any is
// built (a config could otherwise ask for gigabytes of records); one just
// at the bound, with cuts adding partitions, is built.
TEST(LayoutTest, MorePartitionsThanTheBoundAreRefused) {
  const uint64_t at_bound = kMaxPartitions * 16;
  auto built = Layout::Create(LayoutSpec{at_bound, 3, 16, 16});
  ASSERT_TRUE(built.ok()) << built.status();
  EXPECT_EQ(built->partitions().size(), kMaxPartitions);
  for (LayoutSpec over :
       {LayoutSpec{at_bound + 1, 3, 16, 16},
        LayoutSpec{at_bound * 2, 1, 16, 32, {48}} /* the cut adds one */,
        LayoutSpec{kMaxDim, 1, 16, 16}}) {
    const absl::StatusOr<Layout> layout = Layout::Create(over);
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(layout.status().message().find("raise partition_elems"),
              std::string::npos)
        << layout.status();
  }
}

// A job that leaves partition_elems unset gets about eight partitions in its
// largest shard, within [64Ki, 1Mi] elements, on whole blocks.
TEST(LayoutTest, TheDefaultPartitionSizeGivesSmallModelsSeveralPerShard) {
  struct Case {
    uint64_t dim;
    uint32_t shards, block;
    uint32_t want;
  };
  for (const Case& c : std::vector<Case>{
           {1'000'000, 2, 2048, 65536},       // 245 blocks: 8 of 64Ki
           {10'000'000, 2, 2048, 626'688},    // 2442 blocks: 8 of 306
           {25'000'000, 2, 2048, 1u << 20},   // capped: 12 per shard
           {134'000'000, 4, 2048, 1u << 20},  // capped
           {50'000, 1, 2048, 65536},          // floor: one partition
           {4'000'000, 3, 3008, 168'448},     // 444 blocks: 8 of 56
           {1'000'000, 2, 3008, 66'176},      // the floor on whole blocks
           {0, 2, 2048, 1u << 20},            // size not known: the largest
           {0, 2, 3008, 1'049'792}}) {
    const uint32_t p = DefaultPartitionElems(c.dim, c.shards, c.block);
    EXPECT_EQ(p, c.want) << c.dim << " " << c.shards << " " << c.block;
    EXPECT_EQ(p % c.block, 0u);
    if (c.dim == 0) continue;
    const LayoutSpec spec{c.dim, c.shards, c.block, p, {}};
    const absl::StatusOr<Layout> layout = Layout::Create(spec);
    ASSERT_TRUE(layout.ok()) << layout.status();
    size_t most = 0;
    for (uint32_t s = 0; s < c.shards; ++s)
      most = std::max(most, layout->shard_partitions(s).size());
    if (p < kMinDefaultPartitionElems + c.block)
      EXPECT_LE(most, kDefaultPartitionsPerShard) << c.dim;
    else if (p > kMaxDefaultPartitionElems - c.block)
      EXPECT_GE(most, kDefaultPartitionsPerShard) << c.dim;
    else
      EXPECT_EQ(most, kDefaultPartitionsPerShard) << c.dim;
  }
}

// A model too small for a block of 2048 per shard gets the largest power
// of two that gives every shard one; a model that has a block of 2048 for
// every shard, or of unknown size, keeps 2048 (its layout as it was); below
// a block of 16 a shard the layout still refuses.
TEST(LayoutTest, TheDefaultBlockGivesEveryShardOneWhereTheModelAllows) {
  struct Case {
    uint64_t dim;
    uint32_t shards;
    uint32_t want;
  };
  for (const Case& c : std::vector<Case>{{1'000'000, 2, 2048},
                                         {4095, 2, 2048},  // two blocks
                                         {10, 1, 2048},    // one block
                                         {2048, 2, 1024},  // LoRA r=4
                                         {2048, 3, 512},   // 4 blocks
                                         {100, 2, 64},     // 2 blocks
                                         {40, 3, 16},      // 3 blocks
                                         {0, 2, 2048}}) {
    const uint32_t block = DefaultBlockElems(c.dim, c.shards);
    EXPECT_EQ(block, c.want) << c.dim << " " << c.shards;
    if (c.dim == 0) continue;
    const LayoutSpec spec{c.dim,
                          c.shards,
                          block,
                          DefaultPartitionElems(c.dim, c.shards, block),
                          {}};
    const absl::StatusOr<Layout> layout = Layout::Create(spec);
    ASSERT_TRUE(layout.ok())
        << c.dim << " " << c.shards << ": " << layout.status();
    EXPECT_GE(layout->block_count(), c.shards);
  }
  const uint32_t tiny = DefaultBlockElems(10, 2);
  EXPECT_EQ(tiny, 16u);
  EXPECT_FALSE(Layout::Create({10, 2, tiny, tiny, {}}).ok());  // one block
}

}  // namespace
}  // namespace morse::compress
