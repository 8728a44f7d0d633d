#include "compress/update_rules.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

TEST(UpdateRulesTest, AdamMatchesTheTextbookInDoublePrecision) {
  // Three steps of bias-corrected Adam with weight decay, against the same
  // formulas in double: agreement to fp32 rounding.
  const AdamHyper h{0.9f, 0.999f, 1e-8f, 0.01f};
  std::vector<float> x = {1.0f, -2.0f, 0.5f}, m(3, 0), v(3, 0);
  std::vector<double> xd(x.begin(), x.end()), md(3, 0), vd(3, 0);
  const std::vector<std::vector<float>> grads = {
      {0.1f, -0.3f, 2.0f}, {0.2f, 0.1f, -1.0f}, {-0.5f, 0.0f, 0.3f}};
  for (int t = 1; t <= 3; ++t) {
    const float lr = 1e-2f;
    AdamStep(MakeAdamScalars(h, lr, t, true), grads[t - 1], absl::MakeSpan(x),
             absl::MakeSpan(m), absl::MakeSpan(v));
    for (size_t j = 0; j < 3; ++j) {
      const double g = grads[t - 1][j];
      md[j] = 0.9 * md[j] + 0.1 * g;
      vd[j] = 0.999 * vd[j] + 0.001 * g * g;
      const double mh = md[j] / (1 - std::pow(0.9, t)),
                   vh = vd[j] / (1 - std::pow(0.999, t));
      xd[j] -= lr * (mh / (std::sqrt(vh) + 1e-8) + 0.01 * xd[j]);
    }
  }
  for (size_t j = 0; j < 3; ++j) {
    EXPECT_NEAR(x[j], xd[j], 1e-6) << j;
    EXPECT_NEAR(m[j], md[j], 1e-6) << j;
    EXPECT_NEAR(v[j], vd[j], 1e-7) << j;
  }
}

TEST(UpdateRulesTest, WithoutBiasCorrectionTheFactorsAreExactlyOne) {
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 5, false);
  EXPECT_EQ(s.bias_correction1, 1.0f);
  EXPECT_EQ(s.bias_correction2, 1.0f);
  const AdamScalars c = MakeAdamScalars({}, 1e-3f, 1, true);
  // 1 - beta for the fp32 betas 0.9f and 0.999f, rounded once.
  EXPECT_EQ(c.bias_correction1, static_cast<float>(1.0 - double{0.9f}));
  EXPECT_EQ(c.bias_correction2, static_cast<float>(1.0 - double{0.999f}));
}

TEST(UpdateRulesTest, FrozenVarianceReplacesMomentumAndKeepsV) {
  AdamScalars s = MakeAdamScalars({0.9f, 0.999f, 1e-8f, 0.0f}, 0.1f, 1, false);
  std::vector<float> x = {1, 1}, m = {5, 5}, v = {4, 0.25f};
  const std::vector<float> c = {0.5f, -0.5f};
  FrozenVarianceStep(s, c, absl::MakeSpan(x), absl::MakeSpan(m), v);
  EXPECT_EQ(m, c);
  EXPECT_EQ(v, (std::vector<float>{4, 0.25f}));
  EXPECT_FLOAT_EQ(x[0], 1.0f - 0.1f * (0.5f / (2.0f + 1e-8f)));
  EXPECT_FLOAT_EQ(x[1], 1.0f + 0.1f * (0.5f / (0.5f + 1e-8f)));
}

TEST(UpdateRulesTest, LocalMomentum) {
  std::vector<float> out(2);
  LocalMomentum(0.9f, std::vector<float>{1, -1}, std::vector<float>{10, 10},
                absl::MakeSpan(out));
  EXPECT_EQ(out[0], 0.9f * 1.0f + (1.0f - 0.9f) * 10.0f);
  EXPECT_EQ(out[1], 0.9f * -1.0f + (1.0f - 0.9f) * 10.0f);
}

TEST(UpdateRulesTest, LearningRateSchedules) {
  LrSchedule constant{LrSchedule::Kind::kConstant, 0.1f, 4};
  EXPECT_FLOAT_EQ(LearningRate(constant, 0), 0.025f);
  EXPECT_FLOAT_EQ(LearningRate(constant, 3), 0.1f);
  EXPECT_FLOAT_EQ(LearningRate(constant, 1000), 0.1f);
  LrSchedule cosine{LrSchedule::Kind::kCosine, 0.1f, 0, 100, 0.01f};
  EXPECT_FLOAT_EQ(LearningRate(cosine, 0), 0.1f);
  EXPECT_FLOAT_EQ(LearningRate(cosine, 50), 0.055f);
  EXPECT_FLOAT_EQ(LearningRate(cosine, 100), 0.01f);
  EXPECT_FLOAT_EQ(LearningRate(cosine, 500), 0.01f);
  EXPECT_FALSE(
      ValidateLrSchedule({LrSchedule::Kind::kCosine, 0.1f, 10, 5}).ok());
  EXPECT_FALSE(ValidateLrSchedule({LrSchedule::Kind::kConstant, -1.0f}).ok());
  EXPECT_FALSE(ValidateAdamHyper({1.0f, 0.999f, 1e-8f, 0}).ok());
}

// A sync step's local step and message in one pass gives the two passes'
// bits, with an interval's lr sum and with a sum of 0 (every step at lr 0:
// the message is m).
TEST(UpdateRulesTest, ASyncLocalStepInOnePassIsTheTwoPasses) {
  const size_t n = 37;
  AdamScalars s = testing::CorrectedAdamScalars(2e-3f);
  const std::vector<float> g = testing::VariedData(n, 1),
                           x0 = testing::VariedData(n, 2),
                           m0 = testing::VariedData(n, 3),
                           u0 = testing::VariedData(n, 4);
  std::vector<float> v = testing::VariedData(n, 5);
  for (float& e : v) e = e * e;
  for (float lr_sum : {6e-3f, 0.0f}) {
    std::vector<float> x_two = x0, m_two = m0, u_two = u0, out_two(n);
    ZeroOneLocalStep(s, g, absl::MakeSpan(x_two), absl::MakeSpan(m_two),
                     absl::MakeSpan(u_two), v, /*write_x=*/false);
    ZeroOneSyncMessage(s, lr_sum, u_two, m_two, v, absl::MakeSpan(out_two));
    std::vector<float> x_one = x0, m_one = m0, u_one = u0, out_one(n);
    ZeroOneSyncLocalStep(s, s, lr_sum, g, absl::MakeSpan(x_one),
                         absl::MakeSpan(m_one), absl::MakeSpan(u_one), v,
                         /*fresh=*/false, absl::MakeSpan(out_one));
    EXPECT_EQ(x_one, x0) << "lr_sum " << lr_sum;
    EXPECT_EQ(m_one, m_two) << "lr_sum " << lr_sum;
    EXPECT_EQ(u_one, u_two) << "lr_sum " << lr_sum;
    EXPECT_EQ(out_one, out_two) << "lr_sum " << lr_sum;
  }
}

}  // namespace
}  // namespace morse::compress
