// topk's exact bytes: indices ascending then values, ties to the lower index,
// and rejection of indices out of range or out of order.
#include <cmath>
#include <vector>

#include "compress/codec.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

std::vector<uint32_t> Indices(const std::vector<uint8_t>& p, size_t k) {
  std::vector<uint32_t> idx(k);
  std::memcpy(idx.data(), p.data(), 4 * k);
  return idx;
}

TEST(TopKCodecTest, KeepsTheLargestMagnitudesInIndexOrder) {
  CodecSpec spec{CodecKind::kTopK};
  spec.topk_ratio = 0.375f;  // k = 3 of 8
  const std::vector<float> x = {0.1f, -5, 2, 0, 4, -2, 0.5f, 3};
  std::vector<uint8_t> p(PayloadBytes(spec, x.size()));
  ASSERT_EQ(p.size(), 24u);
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(p)).ok());
  EXPECT_EQ(Indices(p, 3), (std::vector<uint32_t>{1, 4, 7}));
  std::vector<float> values(3);
  std::memcpy(values.data(), p.data() + 12, 12);
  EXPECT_EQ(values, (std::vector<float>{-5, 4, 3}));
}

TEST(TopKCodecTest, TiesGoToTheLowerIndex) {
  CodecSpec spec{CodecKind::kTopK};
  spec.topk_ratio = 0.5f;  // k = 2 of 4
  const std::vector<float> x = {1, -2, 2, -2};
  std::vector<uint8_t> p(PayloadBytes(spec, x.size()));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(p)).ok());
  EXPECT_EQ(Indices(p, 2), (std::vector<uint32_t>{1, 2}));
}

TEST(TopKCodecTest, BadIndicesOrValuesAreRejected) {
  CodecSpec spec{CodecKind::kTopK};
  spec.topk_ratio = 0.5f;
  const std::vector<float> x = {1, -2, 3, -4};
  std::vector<uint8_t> good(PayloadBytes(spec, x.size()));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(good)).ok());
  const auto corrupt = [&](size_t offset, uint32_t word) {
    std::vector<uint8_t> p = good;
    std::memcpy(p.data() + offset, &word, 4);
    std::vector<float> out(4, 42.0f);
    const absl::Status s = Decode(spec, p, absl::MakeSpan(out));
    for (float o : out) EXPECT_EQ(o, 42.0f);
    return s.code();
  };
  EXPECT_EQ(corrupt(0, 4), absl::StatusCode::kInvalidArgument);  // out of range
  EXPECT_EQ(corrupt(0, 3),
            absl::StatusCode::kInvalidArgument);  // 3, 3: not ascending
  EXPECT_EQ(corrupt(8, 0x7fc00000u),
            absl::StatusCode::kInvalidArgument);  // NaN value
  std::vector<float> nan_in = {1, NAN, 3, 4};
  EXPECT_EQ(Encode(spec, nan_in, {}, absl::MakeSpan(good)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace morse::compress
