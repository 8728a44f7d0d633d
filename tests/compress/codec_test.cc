// Every codec through the public codec.h: sizes, round trips over the sizes
// the issue names (0, 1, 7, 8, 9, B-1, B, B+1, several MiB), and rejection of
// malformed payloads without touching the output.
#include "compress/codec.h"

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "compress/float_codec.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::VariedData;

constexpr uint32_t kB = kDefaultBlockElems;
const auto kAllCodecs = ::testing::Values(
    CodecKind::kFp32, CodecKind::kFp16, CodecKind::kBf16, CodecKind::kInt8,
    CodecKind::kInt4, CodecKind::kSign1, CodecKind::kTopK);

CodecSpec Spec(CodecKind kind) {
  CodecSpec spec;
  spec.kind = kind;
  spec.topk_ratio = 0.1;
  return spec;
}

TEST(CodecTest, PayloadBytesFollowTheDesign) {
  const size_t n = 5000;  // 3 blocks of 2048
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kFp32), n), 4 * n);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kFp16), n), 2 * n);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kBf16), n), 2 * n);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kInt8), n), 4 * 3 + n);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kInt4), n), 4 * 3 + n / 2);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kInt4), 7), 4 + 4u);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kSign1), n), 4 * 3 + 625);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kSign1), 9), 4 + 2u);
  EXPECT_EQ(PayloadBytes(Spec(CodecKind::kTopK), n), 8 * 500u);
  for (CodecKind kind : {CodecKind::kFp32, CodecKind::kInt8, CodecKind::kSign1,
                         CodecKind::kTopK}) {
    EXPECT_EQ(PayloadBytes(Spec(kind), 0), 0u) << CodecName(kind);
  }
}

TEST(CodecTest, TopKCountRoundsUpAndCaps) {
  EXPECT_EQ(TopKCount(0.1, 0), 0u);
  EXPECT_EQ(TopKCount(0.1, 1), 1u);
  EXPECT_EQ(TopKCount(0.1, 11), 2u);
  EXPECT_EQ(TopKCount(0.1, 5000), 500u);
  EXPECT_EQ(TopKCount(0.01, 1 << 20), 10486u);
  EXPECT_EQ(TopKCount(1.0, 7), 7u);
}

TEST(CodecTest, NamesRoundTripAndUnknownNamesAreErrors) {
  for (CodecKind kind :
       {CodecKind::kFp32, CodecKind::kFp16, CodecKind::kBf16, CodecKind::kInt8,
        CodecKind::kInt4, CodecKind::kSign1, CodecKind::kTopK}) {
    auto parsed = ParseCodecKind(CodecName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_EQ(ParseCodecKind("int3").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseScaleKind("l3").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, InvalidSpecsAreRejected) {
  CodecSpec spec = Spec(CodecKind::kSign1);
  spec.block_elems = 24;
  EXPECT_EQ(ValidateCodecSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec = Spec(CodecKind::kTopK);
  spec.topk_ratio = 0.0f;
  EXPECT_EQ(ValidateCodecSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> x(16, 1.0f);
  std::vector<uint8_t> payload(128);
  EXPECT_EQ(Encode(spec, x, {}, absl::MakeSpan(payload)).code(),
            absl::StatusCode::kInvalidArgument);
}

// The largest error a codec may make on one element of a block whose
// largest magnitude is amax (sign1 is checked separately: its error is not
// bounded by amax alone but the decoded value must be +-scale).
float Tolerance(CodecKind kind, float value, float amax) {
  switch (kind) {
    case CodecKind::kFp32:
      return 0.0f;
    case CodecKind::kFp16:
      return std::max(std::fabs(value) * 0x1p-11f, 0x1p-25f);
    case CodecKind::kBf16:
      return std::fabs(value) * 0x1p-8f;
    case CodecKind::kInt8:
      return amax / 127.0f * 0.5f * 1.0001f;
    case CodecKind::kInt4:
      return amax / 7.0f * 0.5f * 1.0001f;
    default:
      return std::numeric_limits<float>::infinity();
  }
}

class RoundTripTest
    : public ::testing::TestWithParam<std::tuple<CodecKind, size_t>> {};

TEST_P(RoundTripTest, DecodeInvertsEncodeWithinTheCodecsError) {
  const auto [kind, n] = GetParam();
  const CodecSpec spec = Spec(kind);
  // Values inside fp16's range; the magnitudes still vary by 10^9.
  const std::vector<float> x = VariedData(n, static_cast<uint32_t>(n) + 1);
  std::vector<uint8_t> payload(PayloadBytes(spec, n));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(payload)).ok());
  std::vector<float> y(n, std::nanf(""));
  ASSERT_TRUE(Decode(spec, payload, absl::MakeSpan(y)).ok());
  for (size_t start = 0; start < n; start += kB) {
    const size_t len = std::min<size_t>(kB, n - start);
    float amax = 0.0f;
    double sum_sq = 0.0;
    for (size_t j = start; j < start + len; ++j) {
      amax = std::max(amax, std::fabs(x[j]));
      sum_sq += double{x[j]} * x[j];
    }
    for (size_t j = start; j < start + len; ++j) {
      ASSERT_FALSE(std::isnan(y[j])) << "element " << j << " not written";
      if (kind == CodecKind::kSign1) {
        const double rms = std::sqrt(sum_sq / double(len));
        ASSERT_NEAR(std::fabs(y[j]), rms, rms * 1e-5 + 1e-30) << j;
        ASSERT_EQ(std::signbit(y[j]), std::signbit(x[j])) << j;
      } else if (kind == CodecKind::kTopK) {
        ASSERT_TRUE(y[j] == 0.0f || y[j] == x[j]) << j;
      } else {
        ASSERT_LE(std::fabs(y[j] - x[j]), Tolerance(kind, x[j], amax))
            << CodecName(kind) << " element " << j << " of " << x[j];
      }
    }
  }
  if (kind == CodecKind::kTopK && n > 0) {
    // The kept values are the largest ones: none dropped beats a kept one.
    float smallest_kept = std::numeric_limits<float>::infinity();
    float largest_dropped = 0.0f;
    for (size_t j = 0; j < n; ++j) {
      if (y[j] != 0.0f)
        smallest_kept = std::min(smallest_kept, std::fabs(y[j]));
      else
        largest_dropped = std::max(largest_dropped, std::fabs(x[j]));
    }
    EXPECT_GE(smallest_kept, largest_dropped);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllCodecsAllSizes, RoundTripTest,
    ::testing::Combine(kAllCodecs,
                       ::testing::Values(size_t{0}, size_t{1}, size_t{7},
                                         size_t{8}, size_t{9}, size_t{kB - 1},
                                         size_t{kB}, size_t{kB + 1},
                                         size_t{3} << 20 /* 12 MiB of fp32 */)),
    [](const auto& info) {
      return std::string(CodecName(std::get<0>(info.param))) + "_" +
             std::to_string(std::get<1>(info.param));
    });

class MalformedPayloadTest : public ::testing::TestWithParam<CodecKind> {};

TEST_P(MalformedPayloadTest, WrongLengthIsRejectedWithoutWriting) {
  const CodecSpec spec = Spec(GetParam());
  const size_t n = kB + 3;
  const std::vector<float> x = VariedData(n, 7);
  std::vector<uint8_t> payload(PayloadBytes(spec, n));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(payload)).ok());
  for (long delta : {-1L, 1L}) {
    std::vector<uint8_t> bad = payload;
    bad.resize(payload.size() + delta);
    std::vector<float> out(n, 42.0f);
    const absl::Status s = Decode(spec, bad, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("bytes"), absl::string_view::npos) << s;
    for (float o : out) ASSERT_EQ(o, 42.0f);
  }
  // An encoder refuses an output span of the wrong size, too.
  std::vector<uint8_t> small(payload.size() - 1);
  EXPECT_EQ(Encode(spec, x, {}, absl::MakeSpan(small)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(MalformedPayloadTest, AverageRejectsAnyBadPayloadWithoutWriting) {
  const CodecSpec spec = Spec(GetParam());
  const size_t n = 100;
  const std::vector<float> x = VariedData(n, 9);
  std::vector<uint8_t> good(PayloadBytes(spec, n));
  ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(good)).ok());
  std::vector<uint8_t> bad(good.size() + 1);
  std::vector<absl::Span<const uint8_t>> payloads = {good, bad};
  std::vector<float> out(n, 42.0f);
  const absl::Status s = DecodeAverage(spec, payloads, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("payload 1"), absl::string_view::npos) << s;
  for (float o : out) ASSERT_EQ(o, 42.0f);
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, MalformedPayloadTest, kAllCodecs,
                         [](const auto& info) {
                           return std::string(CodecName(info.param));
                         });

class AverageTest : public ::testing::TestWithParam<CodecKind> {};

// The server's average equals decoding each payload and summing in rank
// order from +0, then dividing by N: bit for bit.
TEST_P(AverageTest, AverageIsTheRankOrderSumOfDecodes) {
  const CodecSpec spec = Spec(GetParam());
  const size_t n = 3 * kB + 37 + 5000;  // several of fp32's pieces of 2048
  const size_t workers = 5;
  std::vector<std::vector<uint8_t>> payloads(workers);
  std::vector<float> expected(n, 0.0f);
  for (size_t i = 0; i < workers; ++i) {
    const std::vector<float> x = VariedData(n, 100 + i);
    payloads[i].resize(PayloadBytes(spec, n));
    ASSERT_TRUE(Encode(spec, x, {}, absl::MakeSpan(payloads[i])).ok());
    std::vector<float> decoded(n);
    ASSERT_TRUE(Decode(spec, payloads[i], absl::MakeSpan(decoded)).ok());
    for (size_t j = 0; j < n; ++j) expected[j] += decoded[j];
  }
  for (float& e : expected) e = e / static_cast<float>(workers);
  std::vector<absl::Span<const uint8_t>> views(payloads.begin(),
                                               payloads.end());
  std::vector<float> average(n);
  ASSERT_TRUE(DecodeAverage(spec, views, absl::MakeSpan(average)).ok());
  EXPECT_EQ(testing::FirstBitDifference(average, expected), -1);
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, AverageTest, kAllCodecs,
                         [](const auto& info) {
                           return std::string(CodecName(info.param));
                         });

}  // namespace
}  // namespace morse::compress
