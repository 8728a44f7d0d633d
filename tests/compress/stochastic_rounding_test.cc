#include "compress/stochastic_rounding.h"

#include <vector>

#include "gtest/gtest.h"

namespace morse::compress {
namespace {

// Known answers from Random123's tests/kat_vectors ("philox4x32 10" lines):
// counter[4], key[2] -> result[4].
TEST(StochasticRoundingTest, PhiloxMatchesTheRandom123KnownAnswers) {
  EXPECT_EQ(Philox4x32_10({0, 0}, {0, 0, 0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c,
                                     0x9b00dbd8}));
  EXPECT_EQ(Philox4x32_10({0xffffffff, 0xffffffff},
                          {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6,
                                     0x6d5451fd}));
  EXPECT_EQ(Philox4x32_10({0xa4093822, 0x299f31d0},
                          {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420,
                                     0x24126ea1}));
}

TEST(StochasticRoundingTest, DrawsAreInTheUnitIntervalAndUseAllFourWords) {
  const RoundingKey key{7, 11, 3, 0};
  const auto words = Philox4x32_10({7, 0}, {0, 0, 11, 3});
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(StochasticDraw(key, i),
              static_cast<float>(words[i] >> 8) * 0x1p-24f);
  }
  for (uint64_t i = 0; i < 10000; ++i) {
    const float d = StochasticDraw(key, i);
    ASSERT_GE(d, 0.0f);
    ASSERT_LT(d, 1.0f);
  }
}

TEST(StochasticRoundingTest, RoundsToANeighbour) {
  EXPECT_EQ(StochasticRound(2.25f, 0.0f), 3.0f);
  EXPECT_EQ(StochasticRound(2.25f, 0.25f), 2.0f);
  EXPECT_EQ(StochasticRound(-2.25f, 0.7f), -2.0f);  // frac(-2.25) = 0.75
  EXPECT_EQ(StochasticRound(-2.25f, 0.8f), -3.0f);
  EXPECT_EQ(StochasticRound(4.0f, 0.0f), 4.0f);  // integers never move
}

}  // namespace
}  // namespace morse::compress

namespace morse::compress {
namespace {

TEST(StochasticRoundingTest, FillDrawsEqualsOneDrawAtATime) {
  for (uint64_t first : {0ull, 1ull, 3ull, 4ull, 1001ull}) {
    const RoundingKey key{5, 6, 7, first};
    std::vector<float> bulk(37);
    FillDraws(key, bulk.data(), bulk.size());
    for (size_t i = 0; i < bulk.size(); ++i) {
      ASSERT_EQ(bulk[i], StochasticDraw(key, first + i)) << first << " " << i;
    }
  }
}

}  // namespace
}  // namespace morse::compress
