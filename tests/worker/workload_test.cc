// The built-in workloads: the MLP's backpropagated gradient against finite
// differences, CSV and libsvm giving the same model, data errors with file
// and line, and the synthetic workload's determinism and formula, whole or in
// ranges.
#include "worker/workload.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "absl/strings/str_cat.h"
#include "compress/stochastic_rounding.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"

namespace morse::worker {
namespace {

class WorkloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/morse-workload-XXXXXX";
    dir_ = mkdtemp(pattern);
    // 40 rows, 5 features, 3 classes, as CSV (with a header) and libsvm.
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    std::ofstream csv(dir_ + "/d.csv"), svm(dir_ + "/d.svm");
    csv << "label,a,b,c,d,e\n";
    for (int r = 0; r < 40; ++r) {
      const int label = r % 3;
      csv << label;
      svm << label;
      for (int f = 0; f < 5; ++f) {
        const float v = (f == 2) ? 0.0f : u(rng) + (f == label ? 1.0f : 0.0f);
        csv << "," << v;
        if (v != 0.0f) svm << " " << f + 1 << ":" << v;
      }
      csv << "\n";
      svm << "\n";
    }
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  proto::JobSpec Job(const std::string& file, const std::string& format,
                     int batch_size = 40) {
    auto job = proto::ParseJobConfig(
        absl::StrCat("workers: 1 shards: 1 lr { lr: 0.01 } steps: 10 "
                     "freeze_step: 1 block_elems: 16 "
                     "partition_elems: 16 mlp { train_path: \"",
                     dir_, "/", file, "\" format: \"", format,
                     "\" features: 5 classes: 3 hidden: 4 hidden: 3 "
                     "batch_size: ",
                     batch_size, " }"),
        proto::ConfigFormat::kText);
    EXPECT_TRUE(job.ok()) << job.status();
    return *job;
  }
  std::string dir_;
};

TEST_F(WorkloadTest, MlpGradientMatchesFiniteDifferences) {
  const proto::JobSpec job = Job("d.csv", "csv");
  auto workload = MakeWorkload(job, 0);
  ASSERT_TRUE(workload.ok()) << workload.status();
  std::vector<float> x((*workload)->dim()), g(x.size()), unused(x.size());
  (*workload)->Initialize(absl::MakeSpan(x));
  // Biases start at exactly 0, which can put a pre-activation exactly on the
  // ReLU kink where finite differences see half a slope; move off it.
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> jitter(-0.1f, 0.1f);
  for (float& v : x) v += jitter(rng);
  // batch_size = all 40 rows, so every call sees the same batch (in another
  // order).
  ASSERT_TRUE((*workload)->Gradient(0, x, absl::MakeSpan(g)).ok());
  int checked = 0;
  for (size_t j = 0; j < x.size(); j += 3) {
    const float h = 2e-3f;
    std::vector<float> plus = x, minus = x;
    plus[j] += h;
    minus[j] -= h;
    const double lp = *(*workload)->Gradient(0, plus, absl::MakeSpan(unused));
    const double lm = *(*workload)->Gradient(0, minus, absl::MakeSpan(unused));
    const double numeric = (lp - lm) / (2 * h);
    ASSERT_NEAR(g[j], numeric, 2e-3 + 2e-2 * std::fabs(numeric))
        << "parameter " << j;
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

// A step's batch does not depend on the steps drawn before it: a worker
// resumed or restarted at step s (or replaying from its checkpoint) trains
// on what an uninterrupted one does at s, across passes over the data.
TEST_F(WorkloadTest, MlpBatchesAreAFunctionOfTheStep) {
  const proto::JobSpec job =
      Job("d.csv", "csv", /*batch_size=*/7);  // 40 rows: passes end mid-batch
  auto straight = MakeWorkload(job, 0);
  auto jumping = MakeWorkload(job, 0);
  ASSERT_TRUE(straight.ok() && jumping.ok());
  std::vector<float> x((*straight)->dim());
  (*straight)->Initialize(absl::MakeSpan(x));
  std::vector<std::vector<float>> expected;
  for (int64_t step = 0; step < 30; ++step) {
    std::vector<float> g(x.size());
    ASSERT_TRUE((*straight)->Gradient(step, x, absl::MakeSpan(g)).ok());
    expected.push_back(g);
  }
  EXPECT_NE(expected[0], expected[1]);
  for (int64_t step : {17, 18, 19, 3, 4, 29, 0, 23}) {
    std::vector<float> g(x.size());
    ASSERT_TRUE((*jumping)->Gradient(step, x, absl::MakeSpan(g)).ok());
    EXPECT_EQ(g, expected[step]) << "step " << step;
  }
}

TEST_F(WorkloadTest, CsvAndLibsvmGiveTheSameGradient) {
  auto a = MakeWorkload(Job("d.csv", "csv"), 0);
  auto b = MakeWorkload(Job("d.svm", "libsvm"), 0);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<float> x((*a)->dim()), ga(x.size()), gb(x.size());
  (*a)->Initialize(absl::MakeSpan(x));
  const double la = *(*a)->Gradient(0, x, absl::MakeSpan(ga));
  const double lb = *(*b)->Gradient(0, x, absl::MakeSpan(gb));
  EXPECT_NEAR(la, lb, 1e-5);
  for (size_t j = 0; j < x.size(); ++j) ASSERT_NEAR(ga[j], gb[j], 1e-5) << j;
  // Full-batch accuracy without a test set is not reported.
  EXPECT_FALSE((*a)->TestAccuracy(x).has_value());
}

TEST_F(WorkloadTest, DataErrorsNameTheFileAndLine) {
  std::ofstream(dir_ + "/bad.csv") << "0,1,2,3,4,5\n1,1,2,x,4,5\n";
  std::ofstream(dir_ + "/short.csv") << "0,1,2,3,4,5\n1,1,2\n";
  std::ofstream(dir_ + "/label.csv") << "7,1,2,3,4,5\n";
  std::ofstream(dir_ + "/bad.svm") << "1 9:0.5\n";
  for (const auto& [file, format, words] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"bad.csv", "csv", "bad.csv:2: feature 2"},
           {"short.csv", "csv", "short.csv:2: 2 features"},
           {"label.csv", "csv", "label.csv:1: label 7"},
           {"bad.svm", "libsvm", "bad.svm:1: bad entry '9:0.5'"},
           {"missing.csv", "csv", "cannot read data file"}}) {
    auto w = MakeWorkload(Job(file, format), 0);
    ASSERT_FALSE(w.ok()) << file;
    EXPECT_NE(w.status().message().find(words), absl::string_view::npos)
        << w.status();
  }
}

TEST(SyntheticWorkloadTest, GradientsDependOnStepAndRankOnly) {
  auto job = *proto::ParseJobConfig(
      "workers: 2 shards: 1 synthetic { dim: 1000 } lr { lr: 0.1 } steps: 3 "
      "freeze_step: 1",
      proto::ConfigFormat::kText);
  SyntheticWorkload a(job, 0), b(job, 0), other(job, 1);
  std::vector<float> x(1000, 0.5f), ga(1000), gb(1000), go(1000);
  ASSERT_TRUE(a.Gradient(2, x, absl::MakeSpan(ga)).ok());
  ASSERT_TRUE(b.Gradient(2, x, absl::MakeSpan(gb)).ok());
  ASSERT_TRUE(other.Gradient(2, x, absl::MakeSpan(go)).ok());
  EXPECT_EQ(ga, gb);
  EXPECT_NE(ga, go);
  ASSERT_TRUE(b.Gradient(3, x, absl::MakeSpan(gb)).ok());
  EXPECT_NE(ga, gb);
}

TEST(SyntheticWorkloadTest, GradientIsItsFormulaWholeOrInRanges) {
  auto job = *proto::ParseJobConfig(
      "workers: 4 shards: 1 synthetic { dim: 10007 noise: 0.3 dead_every: 7 } "
      "lr { lr: 0.1 } steps: 3 "
      "freeze_step: 1 seed: 11",
      proto::ConfigFormat::kText);
  SyntheticWorkload w(job, 3);
  const size_t n = 10007;
  std::vector<float> x(n), whole(n), pieces(n, -7.0f);
  for (size_t j = 0; j < n; ++j) x[j] = std::sin(0.37 * static_cast<double>(j));
  auto loss = w.Gradient(5, x, absl::MakeSpan(whole));
  ASSERT_TRUE(loss.ok()) << loss.status();
  // The formula element by element, with the scalar Philox draw.
  const auto a = w.curvature(), t = w.target();
  double reference_loss = 0.0;
  for (size_t j = 0; j < n; ++j) {
    const float d = x[j] - t[j];
    const float u = compress::StochasticDraw({11, 5, 3, 0}, j);
    const float g = j % 7 == 0 ? 0.0f : a[j] * d + 0.3f * (2.0f * u - 1.0f);
    ASSERT_EQ(std::memcmp(&g, &whole[j], 4), 0)
        << "element " << j << ": " << g << " vs " << whole[j];
    reference_loss += 0.5 * double{a[j]} * double{d} * double{d};
  }
  EXPECT_NEAR(*loss, reference_loss / n, 1e-12 * std::abs(reference_loss / n));
  // Ranges in increasing order: the same floats and the same loss.
  double lanes[4] = {0, 0, 0, 0};
  const uint64_t cuts[] = {0, 1, 6, 1030, 5003, 5003, n};
  for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
    ASSERT_TRUE(w.GradientRange(5, x, absl::MakeSpan(pieces), cuts[c],
                                cuts[c + 1], lanes)
                    .ok());
  }
  EXPECT_EQ(std::memcmp(pieces.data(), whole.data(), 4 * n), 0);
  EXPECT_EQ((lanes[0] + lanes[1] + (lanes[2] + lanes[3])) / n, *loss);
  // Ranges outside the model are refused.
  EXPECT_EQ(
      w.GradientRange(5, x, absl::MakeSpan(pieces), 5, n + 1, lanes).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.GradientRange(5, x, absl::MakeSpan(pieces), 9, 8, lanes).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace morse::worker
