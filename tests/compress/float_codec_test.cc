// fp16 and bf16 conversions: round to nearest even, subnormals, overflow,
// NaN; checked exhaustively against the inverse and against the CPU's own
// F16C instruction where the CPU has it.
#include "compress/float_codec.h"

#include <immintrin.h>

#include <cmath>
#include <random>
#include <vector>

#include "compress/codec.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::Bits;

TEST(FloatCodecTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);    // the tie rounds to infinity
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);    // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);    // tie to even: zero
  EXPECT_EQ(FloatToHalf(0x1.8p-24f), 0x0002);  // tie to even: 2
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7C00);
  EXPECT_EQ(FloatToHalf(NAN) & 0x7C00, 0x7C00);
  EXPECT_NE(FloatToHalf(NAN) & 0x03FF, 0);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to even (1).
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-10f + 0x1p-11f), 0x3C02);
}

TEST(FloatCodecTest, EveryHalfSurvivesARoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

__attribute__((target("f16c"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(FloatCodecTest, MatchesTheF16cInstruction) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C";
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = testing::BitsFloatForTest(any(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), HardwareHalf(f)) << std::hexfloat << f;
  }
}

TEST(FloatCodecTest, Bfloat16KnownValues) {
  EXPECT_EQ(FloatToBfloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBfloat16(-0.0f), 0x8000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1).
  EXPECT_EQ(FloatToBfloat16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(FloatToBfloat16(1.0f + 0x1p-7f + 0x1p-8f), 0x3F82);
  EXPECT_EQ(FloatToBfloat16(3.4e38f), 0x7F80);  // rounds past the max
  EXPECT_EQ(FloatToBfloat16(INFINITY), 0x7F80);
  EXPECT_TRUE(std::isnan(Bfloat16ToFloat(FloatToBfloat16(NAN))));
  EXPECT_EQ(Bits(Bfloat16ToFloat(0x3F82)), 0x3F820000u);
}

TEST(FloatCodecTest, Bfloat16RoundsToTheNearerNeighbour) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = testing::BitsFloatForTest(any(rng));
    if (std::isnan(f) || std::isinf(f)) continue;
    const uint32_t g = Bits(Bfloat16ToFloat(FloatToBfloat16(f)));
    // The bf16 values on either side of f: truncated, and one unit further
    // from zero (which may be infinity, worth 2^128 for rounding).
    const uint32_t toward_zero = Bits(f) & 0xFFFF0000u;
    const uint32_t away = toward_zero + 0x10000u;
    const auto value = [](uint32_t bits) {
      const float v = testing::BitsFloatForTest(bits);
      return std::isinf(v) ? std::copysign(0x1p128, v) : double{v};
    };
    const double d_zero = std::fabs(double{f} - value(toward_zero));
    const double d_away = std::fabs(double{f} - value(away));
    const uint32_t nearer = d_zero < d_away             ? toward_zero
                            : d_away < d_zero           ? away
                            : ((toward_zero >> 16) & 1) ? away
                                                        : toward_zero;
    ASSERT_EQ(g, nearer) << std::hexfloat << f;
  }
}

TEST(FloatCodecTest, WireBytesAreLittleEndian) {
  const std::vector<float> x = {1.0f, -2.0f};
  std::vector<uint8_t> p(4);
  ASSERT_TRUE(Encode({CodecKind::kFp16}, x, {}, absl::MakeSpan(p)).ok());
  EXPECT_EQ(p, (std::vector<uint8_t>{0x00, 0x3C, 0x00, 0xC0}));
  ASSERT_TRUE(Encode({CodecKind::kBf16}, x, {}, absl::MakeSpan(p)).ok());
  EXPECT_EQ(p, (std::vector<uint8_t>{0x80, 0x3F, 0x00, 0xC0}));
}

}  // namespace
}  // namespace morse::compress
