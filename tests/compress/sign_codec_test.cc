// sign1's exact wire bytes (DESIGN 2.3): scale first, bit j of byte j/8 LSB
// first, -0.0 counts as negative, zero blocks, and both scale kinds.
#include <cmath>
#include <vector>

#include "compress/codec.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

float ScaleAt(const std::vector<uint8_t>& payload, size_t block) {
  float s;
  std::memcpy(&s, payload.data() + 4 * block, 4);
  return s;
}

std::vector<uint8_t> EncodeSign(const std::vector<float>& x, ScaleKind scale,
                                uint32_t block = 16) {
  CodecSpec spec{CodecKind::kSign1, block, scale};
  std::vector<uint8_t> payload(PayloadBytes(spec, x.size()));
  EXPECT_TRUE(Encode(spec, x, {}, absl::MakeSpan(payload)).ok());
  return payload;
}

TEST(SignCodecTest, HandCheckedBytes) {
  // 9 elements, one block: RMS of {3, -4, 0, -0, 1, 1, -1, 1, 2} is
  // sqrt((9+16+0+0+1+1+1+1+4)/9) = sqrt(33/9).
  const std::vector<float> x = {3, -4, 0, -0.0f, 1, 1, -1, 1, 2};
  const std::vector<uint8_t> p = EncodeSign(x, ScaleKind::kL2);
  ASSERT_EQ(p.size(), 4u + 2u);
  EXPECT_EQ(ScaleAt(p, 0), std::sqrt(33.0f / 9.0f));
  // Negative: elements 1, 3 (-0.0) and 6 -> byte 0 = 0b0100'1010.
  EXPECT_EQ(p[4], 0x4A);
  EXPECT_EQ(p[5], 0x00);  // element 8 positive, bits past n zero
  std::vector<float> y(9);
  ASSERT_TRUE(Decode({CodecKind::kSign1, 16}, p, absl::MakeSpan(y)).ok());
  const float s = ScaleAt(p, 0);
  EXPECT_EQ(y, (std::vector<float>{s, -s, s, -s, s, s, -s, s, s}));
}

TEST(SignCodecTest, L1ScaleIsTheMeanAbsoluteValue) {
  const std::vector<float> x = {3, -4, 0, -0.0f, 1, 1, -1, 1, 2};
  const std::vector<uint8_t> p = EncodeSign(x, ScaleKind::kL1);
  EXPECT_EQ(ScaleAt(p, 0), 13.0f / 9.0f);
}

TEST(SignCodecTest, ScalesArePerBlockAndTheLastBlockIsShorter) {
  std::vector<float> x(40);
  for (size_t j = 0; j < 40; ++j)
    x[j] = j < 16 ? 2.0f : (j < 32 ? -0.5f : 8.0f);
  const std::vector<uint8_t> p = EncodeSign(x, ScaleKind::kL2);
  ASSERT_EQ(p.size(), 3 * 4u + 5u);
  EXPECT_EQ(ScaleAt(p, 0), 2.0f);
  EXPECT_EQ(ScaleAt(p, 1), 0.5f);
  EXPECT_EQ(ScaleAt(p, 2), 8.0f);  // 8 elements only
  EXPECT_EQ(p[12], 0x00);
  EXPECT_EQ(p[13], 0x00);
  EXPECT_EQ(p[14], 0xFF);
  EXPECT_EQ(p[15], 0xFF);
  EXPECT_EQ(p[16], 0x00);
}

TEST(SignCodecTest, AllZeroBlockHasZeroScaleAndDecodesToZero) {
  std::vector<float> x(16, 0.0f);
  x[3] = -0.0f;
  const std::vector<uint8_t> p = EncodeSign(x, ScaleKind::kL2);
  EXPECT_EQ(testing::Bits(ScaleAt(p, 0)), 0u);
  EXPECT_EQ(p[4], 0x08);
  std::vector<float> y(16, 1.0f);
  ASSERT_TRUE(Decode({CodecKind::kSign1, 16}, p, absl::MakeSpan(y)).ok());
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(SignCodecTest, NonFiniteInputIsAnError) {
  CodecSpec spec{CodecKind::kSign1, 16};
  for (float bad : {INFINITY, NAN, 3e20f /* its square overflows */}) {
    std::vector<float> x(20, 1.0f);
    x[17] = bad;
    std::vector<uint8_t> payload(PayloadBytes(spec, x.size()));
    const absl::Status s = Encode(spec, x, {}, absl::MakeSpan(payload));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("not finite"), absl::string_view::npos) << s;
  }
}

TEST(SignCodecTest, NonFiniteOrNegativeScaleIsRejectedWithoutWriting) {
  CodecSpec spec{CodecKind::kSign1, 16};
  std::vector<float> x(40, 1.0f);
  std::vector<uint8_t> payload(PayloadBytes(spec, x.size()));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(payload)).ok());
  for (float bad : {INFINITY, -INFINITY, NAN, -1.0f}) {
    std::vector<uint8_t> corrupt = payload;
    std::memcpy(corrupt.data() + 4, &bad, 4);  // block 1
    std::vector<float> out(40, 42.0f);
    const absl::Status s = Decode(spec, corrupt, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("block 1"), absl::string_view::npos) << s;
    for (float o : out) ASSERT_EQ(o, 42.0f);
  }
}

}  // namespace
}  // namespace morse::compress
