// Error feedback (DESIGN 2.4): conservation with ef, ema(1) == ef bit for
// bit, int8 storage, and the property that makes it worth having: 1-bit SGD
// on a quadratic converges with it and stalls without it.
#include "compress/error_feedback.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::VariedData;

constexpr uint32_t kBlock = 64;

std::vector<float> Compress(ErrorFeedback& fb, const CodecSpec& codec,
                            const std::vector<float>& x, size_t offset = 0) {
  std::vector<uint8_t> payload(PayloadBytes(codec, x.size()));
  EXPECT_TRUE(fb.Compress(codec, offset, x, {}, absl::MakeSpan(payload)).ok());
  std::vector<float> sent(x.size());
  EXPECT_TRUE(Decode(codec, payload, absl::MakeSpan(sent)).ok());
  return sent;
}

class ConservationTest : public ::testing::TestWithParam<CodecKind> {};

// With ef nothing is lost: sum of everything sent + final error = sum of
// inputs, element by element (up to fp32 rounding of the running sums).
TEST_P(ConservationTest, SentPlusErrorEqualsInputs) {
  CodecSpec codec{GetParam(), kBlock};
  codec.topk_ratio = 0.05f;
  const size_t n = 1000;
  ErrorFeedback fb({FeedbackKind::kEf}, n, kBlock);
  std::vector<double> inputs(n, 0.0), sent(n, 0.0), magnitude(n, 0.0);
  for (int step = 0; step < 50; ++step) {
    const std::vector<float> x = VariedData(n, 100 + step);
    const std::vector<float> c = Compress(fb, codec, x);
    for (size_t j = 0; j < n; ++j) {
      inputs[j] += x[j];
      sent[j] += c[j];
      magnitude[j] += std::fabs(x[j]) + std::fabs(c[j]);
    }
  }
  std::vector<float> error(n);
  fb.Read(0, absl::MakeSpan(error));
  for (size_t j = 0; j < n; ++j) {
    // Each step rounds u = x + e and e = u - c once each in fp32.
    ASSERT_NEAR(sent[j] + error[j], inputs[j], 4 * 0x1p-24 * magnitude[j]) << j;
  }
  EXPECT_GT(fb.SquaredNorm(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Codecs, ConservationTest,
                         ::testing::Values(CodecKind::kSign1, CodecKind::kInt4,
                                           CodecKind::kInt8, CodecKind::kTopK,
                                           CodecKind::kBf16),
                         [](const auto& info) {
                           return std::string(CodecName(info.param));
                         });

TEST(ErrorFeedbackTest, EmaWithBetaOneIsEfBitForBit) {
  for (CodecKind kind :
       {CodecKind::kSign1, CodecKind::kInt4, CodecKind::kTopK}) {
    CodecSpec codec{kind, kBlock};
    const size_t n = 777;
    ErrorFeedback ef({FeedbackKind::kEf}, n, kBlock);
    ErrorFeedback ema({FeedbackKind::kEma, 1.0f}, n, kBlock);
    for (int step = 0; step < 10; ++step) {
      const std::vector<float> x = VariedData(n, step);
      EXPECT_TRUE(
          testing::SameBits(Compress(ef, codec, x), Compress(ema, codec, x)));
    }
    std::vector<float> a(n), b(n);
    ef.Read(0, absl::MakeSpan(a));
    ema.Read(0, absl::MakeSpan(b));
    EXPECT_EQ(testing::FirstBitDifference(a, b), -1) << CodecName(kind);
  }
}

TEST(ErrorFeedbackTest, EmaFollowsItsFormula) {
  const CodecSpec codec{CodecKind::kSign1, 16};
  const float beta = 0.25f;
  ErrorFeedback fb({FeedbackKind::kEma, beta}, 16, 16);
  const std::vector<float> x1 = VariedData(16, 1), x2 = VariedData(16, 2);
  const std::vector<float> c1 = Compress(fb, codec, x1);
  std::vector<float> e1(16);
  fb.Read(0, absl::MakeSpan(e1));
  for (size_t j = 0; j < 16; ++j) {
    const float expected = (1.0f - beta) * 0.0f + beta * (x1[j] - c1[j]);
    ASSERT_EQ(e1[j], expected);
  }
  const std::vector<float> c2 = Compress(fb, codec, x2);
  std::vector<float> e2(16);
  fb.Read(0, absl::MakeSpan(e2));
  for (size_t j = 0; j < 16; ++j) {
    const float u = x2[j] + e1[j];
    ASSERT_EQ(e2[j], (1.0f - beta) * e1[j] + beta * (u - c2[j]));
  }
}

TEST(ErrorFeedbackTest, NoneSendsTheInputAlone) {
  const CodecSpec codec{CodecKind::kSign1, kBlock};
  ErrorFeedback fb({FeedbackKind::kNone}, 100, kBlock);
  const std::vector<float> x = VariedData(100, 3);
  std::vector<uint8_t> a(PayloadBytes(codec, 100)), b(a.size());
  ASSERT_TRUE(fb.Compress(codec, 0, x, {}, absl::MakeSpan(a)).ok());
  ASSERT_TRUE(Encode(codec, x, {}, absl::MakeSpan(b)).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(fb.SquaredNorm(), 0.0);
}

TEST(ErrorFeedbackTest, Int8StorageTracksFp32Storage) {
  const CodecSpec codec{CodecKind::kSign1, kBlock};
  const size_t n = 4096;
  ErrorFeedback fp32({FeedbackKind::kEf}, n, kBlock);
  ErrorFeedback int8({FeedbackKind::kEf, 1.0f, ErrorStorage::kInt8}, n, kBlock);
  const std::vector<float> x = VariedData(n, 5);
  Compress(fp32, codec, x);
  Compress(int8, codec, x);
  std::vector<float> a(n), b(n);
  fp32.Read(0, absl::MakeSpan(a));
  int8.Read(0, absl::MakeSpan(b));
  for (size_t start = 0; start < n; start += kBlock) {
    float amax = 0;
    for (size_t j = start; j < start + kBlock; ++j)
      amax = std::max(amax, std::fabs(a[j]));
    for (size_t j = start; j < start + kBlock; ++j) {
      ASSERT_LE(std::fabs(a[j] - b[j]), amax / 127.0f * 0.5001f) << j;
    }
  }
}

TEST(ErrorFeedbackTest, RangesAreChecked) {
  const CodecSpec codec{CodecKind::kSign1, kBlock};
  ErrorFeedback fb({FeedbackKind::kEf}, 1000, kBlock);
  std::vector<float> x(100, 1.0f);
  std::vector<uint8_t> payload(PayloadBytes(codec, 100));
  EXPECT_EQ(fb.Compress(codec, 10, x, {}, absl::MakeSpan(payload)).code(),
            absl::StatusCode::kOutOfRange);  // not block-aligned
  EXPECT_EQ(fb.Compress(codec, 960, x, {}, absl::MakeSpan(payload)).code(),
            absl::StatusCode::kOutOfRange);  // past the end
  EXPECT_EQ(fb.SquaredNorm(), 0.0);
  // Partitions at block-aligned offsets update only their own range.
  EXPECT_TRUE(fb.Compress(codec, 128, x, {}, absl::MakeSpan(payload)).ok());
  std::vector<float> e(1000);
  fb.Read(0, absl::MakeSpan(e));
  for (size_t j = 0; j < 1000; ++j) {
    if (j < 128 || j >= 228) {
      ASSERT_EQ(e[j], 0.0f) << j;
    }
  }
}

TEST(ErrorFeedbackTest, RestoreValidatesBeforeChanging) {
  ErrorFeedback fb({FeedbackKind::kEf}, 4, 16);
  EXPECT_EQ(fb.Restore(std::vector<float>{1, 2, 3}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fb.Restore(std::vector<float>{1, NAN, 3, 4}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fb.SquaredNorm(), 0.0);
  ASSERT_TRUE(fb.Restore(std::vector<float>{1, 2, 3, 4}).ok());
  EXPECT_EQ(fb.SquaredNorm(), 30.0);
}

// Distributed 1-bit gradient descent, as 1-bit Adam's messages travel: N
// workers hold f_i(x) = 0.5 sum_j a_ij (x_j - t_ij)^2, each sends sign1 of
// its gradient, the server averages and recompresses with sign1, and x moves
// by -lr * reply. Without feedback the average of signs has a fixed point
// away from the optimum of sum_i f_i; with ef on both sides it is unbiased.
// Returns f(x) - f(x*) after the run.
double DistributedOneBitGap(FeedbackKind kind) {
  const size_t n = 256, workers = 4;
  const uint32_t block = 64;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> curvature(0.1f, 1.0f),
      target(-1.0f, 1.0f);
  std::vector<std::vector<float>> a(workers, std::vector<float>(n)), t = a;
  for (size_t i = 0; i < workers; ++i) {
    for (size_t j = 0; j < n; ++j) {
      a[i][j] = curvature(rng);
      t[i][j] = target(rng);
    }
  }
  const auto loss = [&](const std::vector<double>& x) {
    double f = 0.0;
    for (size_t i = 0; i < workers; ++i) {
      for (size_t j = 0; j < n; ++j)
        f += 0.5 * a[i][j] * (x[j] - t[i][j]) * (x[j] - t[i][j]);
    }
    return f / workers;
  };
  std::vector<double> optimum(n);
  for (size_t j = 0; j < n; ++j) {
    double num = 0, den = 0;
    for (size_t i = 0; i < workers; ++i) {
      num += double{a[i][j]} * t[i][j];
      den += a[i][j];
    }
    optimum[j] = num / den;
  }
  const CodecSpec codec{CodecKind::kSign1, block};
  std::vector<ErrorFeedback> worker_fb;
  for (size_t i = 0; i < workers; ++i)
    worker_fb.emplace_back(FeedbackSpec{kind}, n, block);
  ErrorFeedback server_fb({kind}, n, block);
  std::vector<float> x(n, 0.0f), g(n);
  for (int step = 0; step < 4000; ++step) {
    std::vector<std::vector<uint8_t>> pushes(
        workers, std::vector<uint8_t>(PayloadBytes(codec, n)));
    for (size_t i = 0; i < workers; ++i) {
      for (size_t j = 0; j < n; ++j) g[j] = a[i][j] * (x[j] - t[i][j]);
      EXPECT_TRUE(worker_fb[i]
                      .Compress(codec, 0, g, {}, absl::MakeSpan(pushes[i]))
                      .ok());
    }
    std::vector<absl::Span<const uint8_t>> views(pushes.begin(), pushes.end());
    std::vector<float> average(n);
    EXPECT_TRUE(DecodeAverage(codec, views, absl::MakeSpan(average)).ok());
    const std::vector<float> reply = Compress(server_fb, codec, average);
    const float lr = 0.5f / (1.0f + step / 50.0f);
    for (size_t j = 0; j < n; ++j) x[j] -= lr * reply[j];
  }
  return loss(std::vector<double>(x.begin(), x.end())) - loss(optimum);
}

TEST(ErrorFeedbackTest, DistributedOneBitDescentConvergesOnlyWithFeedback) {
  const double with = DistributedOneBitGap(FeedbackKind::kEf);
  const double without = DistributedOneBitGap(FeedbackKind::kNone);
  std::printf(
      "distributed 1-bit descent, 4 workers, 4000 steps: "
      "f - f* = %.3g with ef, %.3g without\n",
      with, without);
  EXPECT_LT(with, 1e-3);
  EXPECT_GT(without, 10 * with);
}

}  // namespace
}  // namespace morse::compress
