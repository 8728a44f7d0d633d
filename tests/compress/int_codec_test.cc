// int8 and int4 exact bytes (DESIGN 2.3): scale = max|u|/q_max, round half
// to even, two's complement, element 2k in the low nibble; stochastic
// rounding keyed by (seed, step, rank, index).
#include <cmath>
#include <vector>

#include "compress/codec.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

std::vector<uint8_t> EncodeInt(CodecKind kind, const std::vector<float>& x,
                               Rounding rounding = Rounding::kNearestEven,
                               RoundingKey key = {}) {
  CodecSpec spec{kind, 16};
  spec.rounding = rounding;
  std::vector<uint8_t> payload(PayloadBytes(spec, x.size()));
  EXPECT_TRUE(Encode(spec, x, key, absl::MakeSpan(payload)).ok());
  return payload;
}

TEST(IntCodecTest, Int8HandCheckedBytes) {
  // max|u| = 127 -> s = 1, so u/s is exact and the ties are real ties.
  const std::vector<float> x = {127,  -127, 0,     -0.0f,
                                2.5f, 3.5f, -2.5f, -126.5f};
  const std::vector<uint8_t> p = EncodeInt(CodecKind::kInt8, x);
  ASSERT_EQ(p.size(), 4u + 8u);
  float scale;
  std::memcpy(&scale, p.data(), 4);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(
      std::vector<uint8_t>(p.begin() + 4, p.end()),
      (std::vector<uint8_t>{0x7F, 0x81, 0x00, 0x00, 0x02, 0x04, 0xFE, 0x82}));
  std::vector<float> y(x.size());
  ASSERT_TRUE(Decode({CodecKind::kInt8, 16}, p, absl::MakeSpan(y)).ok());
  EXPECT_EQ(y, (std::vector<float>{127, -127, 0, 0, 2, 4, -2, -126}));
}

TEST(IntCodecTest, RoundsHalfToEven) {
  // s = 7/7 = 1, so u/s is u itself and the ties are exact.
  const std::vector<float> x = {7,     0.5f,  1.5f,  2.5f,
                                -0.5f, -1.5f, -2.5f, 3.49f};
  const std::vector<uint8_t> p = EncodeInt(CodecKind::kInt4, x);
  ASSERT_EQ(p.size(), 4u + 4u);
  // q = {7, 0, 2, 2, 0, -2, -2, 3}: nibbles low first.
  EXPECT_EQ(p[4], 0x07);  // 7, 0
  EXPECT_EQ(p[5], 0x22);  // 2, 2
  EXPECT_EQ(p[6], 0xE0);  // 0, -2 (0xE)
  EXPECT_EQ(p[7], 0x3E);  // -2, 3
}

TEST(IntCodecTest, OddCountLeavesTheLastHighNibbleZero) {
  const std::vector<float> x = {-7, 7, -7};
  const std::vector<uint8_t> p = EncodeInt(CodecKind::kInt4, x);
  ASSERT_EQ(p.size(), 4u + 2u);
  EXPECT_EQ(p[4], 0x79);  // -7 = 0x9 low, 7 high
  EXPECT_EQ(p[5], 0x09);
}

TEST(IntCodecTest, AllZeroBlockHasZeroScale) {
  const std::vector<uint8_t> p =
      EncodeInt(CodecKind::kInt8, std::vector<float>(16, 0.0f));
  for (uint8_t b : p) EXPECT_EQ(b, 0);
}

TEST(IntCodecTest, OutOfRangeValuesAndBadScalesAreRejected) {
  const std::vector<float> x = {1, 2, 3};
  for (CodecKind kind : {CodecKind::kInt8, CodecKind::kInt4}) {
    const CodecSpec spec{kind, 16};
    std::vector<uint8_t> p = EncodeInt(kind, x);
    std::vector<float> out(3, 42.0f);
    std::vector<uint8_t> bad = p;
    bad[4] = kind == CodecKind::kInt8 ? 0x80 : 0x08;  // -128 / nibble -8
    EXPECT_EQ(Decode(spec, bad, absl::MakeSpan(out)).code(),
              absl::StatusCode::kInvalidArgument);
    bad = p;
    const float nan = NAN;
    std::memcpy(bad.data(), &nan, 4);
    EXPECT_EQ(Decode(spec, bad, absl::MakeSpan(out)).code(),
              absl::StatusCode::kInvalidArgument);
    for (float o : out) ASSERT_EQ(o, 42.0f);
  }
  std::vector<uint8_t> p = EncodeInt(CodecKind::kInt4, x);
  p[5] |= 0x70;  // the unused high nibble of an odd count
  std::vector<float> out(3);
  EXPECT_EQ(Decode({CodecKind::kInt4, 16}, p, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(IntCodecTest, InfOrNanInputIsAnError) {
  for (CodecKind kind : {CodecKind::kInt8, CodecKind::kInt4}) {
    CodecSpec spec{kind, 16};
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      std::vector<float> x(20, 1.0f);
      x[3] = bad;
      std::vector<uint8_t> p(PayloadBytes(spec, x.size()));
      EXPECT_EQ(Encode(spec, x, {}, absl::MakeSpan(p)).code(),
                absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(IntCodecTest, StochasticRoundingIsKeyedAndUnbiased) {
  // Every element is 0.3 * s after scaling: q must be 0 or 1 (never else),
  // about 30% ones, the same bits for the same key, others for another key.
  const size_t n = 1 << 16;
  std::vector<float> x(n, 0.3f);
  x[0] = 7.0f;  // s = 1 in the first block; set every block's max the same
  for (size_t j = 0; j < n; j += 16) x[j] = 7.0f;
  const RoundingKey key{42, 3, 1, 1000};
  const auto a = EncodeInt(CodecKind::kInt4, x, Rounding::kStochastic, key);
  const auto b = EncodeInt(CodecKind::kInt4, x, Rounding::kStochastic, key);
  EXPECT_EQ(a, b);
  for (RoundingKey other :
       {RoundingKey{43, 3, 1, 1000}, RoundingKey{42, 4, 1, 1000},
        RoundingKey{42, 3, 2, 1000}, RoundingKey{42, 3, 1, 1016}}) {
    EXPECT_NE(a, EncodeInt(CodecKind::kInt4, x, Rounding::kStochastic, other));
  }
  std::vector<float> y(n);
  CodecSpec spec{CodecKind::kInt4, 16};
  ASSERT_TRUE(Decode(spec, a, absl::MakeSpan(y)).ok());
  size_t ones = 0, count = 0;
  for (size_t j = 0; j < n; ++j) {
    if (j % 16 == 0) continue;
    ASSERT_TRUE(y[j] == 0.0f || y[j] == 1.0f) << y[j];
    ones += y[j] == 1.0f;
    ++count;
  }
  const double p = double(ones) / double(count);
  EXPECT_NEAR(p, 0.3, 0.01);  // 61440 draws: 5 sigma is about 0.009
}

TEST(IntCodecTest, StochasticDrawsDependOnTheGlobalIndexOnly) {
  // Encoding [first_index, +32) in one call or as two 16-element halves with
  // shifted first_index gives the same elements.
  std::vector<float> x(32);
  for (size_t j = 0; j < 32; ++j)
    x[j] = (j % 16 == 0) ? 7.0f : 0.5f + 0.01f * j;
  const auto whole =
      EncodeInt(CodecKind::kInt8, x, Rounding::kStochastic, {9, 1, 0, 64});
  const std::vector<float> hi(x.begin() + 16, x.end());
  const auto half =
      EncodeInt(CodecKind::kInt8, hi, Rounding::kStochastic, {9, 1, 0, 80});
  EXPECT_TRUE(std::equal(half.begin() + 4, half.end(), whole.begin() + 8 + 16));
}

}  // namespace
}  // namespace morse::compress
