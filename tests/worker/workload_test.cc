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

// A node of 2 local ranks (local_ranks 2) on worker 1 of 2: data ranks 2
// and 3 of 4, each on its own rows; the node's gradient their average, the
// same floats as two workers of a 4-worker job averaged here.
TEST_F(WorkloadTest, ANodesLocalRanksTrainOnTheirShareOfTheRows) {
  const std::string data = "/d.csv";
  const auto job_of = [&](const std::string& shape) {
    auto job = proto::ParseJobConfig(
        absl::StrCat(shape,
                     " shards: 1 lr { lr: 0.01 } steps: 10 freeze_step: 1 "
                     "block_elems: 16 partition_elems: 16 mlp { train_path: "
                     "\"",
                     dir_, data,
                     "\" features: 5 classes: 3 hidden: 4 batch_size: 4 }"),
        proto::ConfigFormat::kText);
    EXPECT_TRUE(job.ok()) << job.status();
    return *job;
  };
  auto node = MakeWorkload(job_of("workers: 2 local_ranks: 2"), 1);
  auto two = MakeWorkload(job_of("workers: 4"), 2);
  auto three = MakeWorkload(job_of("workers: 4"), 3);
  ASSERT_TRUE(node.ok() && two.ok() && three.ok()) << node.status();
  EXPECT_EQ((*node)->samples_per_step(), 8u);
  const size_t n = (*node)->dim();
  std::vector<float> x(n), got(n), g2(n), g3(n);
  (*node)->Initialize(absl::MakeSpan(x));
  for (int64_t step = 0; step < 3; ++step) {
    auto loss = (*node)->Gradient(step, x, absl::MakeSpan(got));
    auto l2 = (*two)->Gradient(step, x, absl::MakeSpan(g2));
    auto l3 = (*three)->Gradient(step, x, absl::MakeSpan(g3));
    ASSERT_TRUE(loss.ok() && l2.ok() && l3.ok()) << loss.status();
    for (size_t j = 0; j < n; ++j) {
      const float want = (g2[j] + g3[j]) / 2.0f;
      ASSERT_EQ(std::memcmp(&want, &got[j], 4), 0)
          << "step " << step << " element " << j;
    }
    EXPECT_EQ(*loss, (*l2 + *l3) / 2);
    EXPECT_NE(g2, g3);  // the ranks' rows differ
  }
}

// A node of 3 local ranks of the synthetic workload (worker 1 of 2: data
// ranks 3, 4, 5): ((g3 + g4) + g5) / 3 in float, whole or in ranges.
TEST(SyntheticWorkloadTest, ANodesGradientIsItsLocalRanksAverageInOrder) {
  auto job = *proto::ParseJobConfig(
      "workers: 2 local_ranks: 3 shards: 1 synthetic { dim: 5003 noise: 0.3 "
      "dead_every: 5 } lr { lr: 0.1 } steps: 3 freeze_step: 1 seed: 4",
      proto::ConfigFormat::kText);
  auto node = MakeWorkload(job, 1);
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_TRUE((*node)->ComputesRanges());
  const size_t n = 5003;
  std::vector<float> x(n), whole(n), pieces(n, -7.0f);
  for (size_t j = 0; j < n; ++j) x[j] = std::cos(0.11 * static_cast<double>(j));
  auto loss = (*node)->Gradient(2, x, absl::MakeSpan(whole));
  ASSERT_TRUE(loss.ok()) << loss.status();
  std::vector<std::vector<float>> own(3, std::vector<float>(n));
  double rank_loss = 0;
  for (uint32_t k = 0; k < 3; ++k) {
    SyntheticWorkload rank(job, 3 + k);
    auto l = rank.Gradient(2, x, absl::MakeSpan(own[k]));
    ASSERT_TRUE(l.ok());
    rank_loss = *l;  // the synthetic loss does not depend on the rank
  }
  for (size_t j = 0; j < n; ++j) {
    const float want = ((own[0][j] + own[1][j]) + own[2][j]) / 3.0f;
    ASSERT_EQ(std::memcmp(&want, &whole[j], 4), 0) << "element " << j;
  }
  EXPECT_NEAR(*loss, rank_loss, 1e-12 * rank_loss);
  double lanes[4] = {0, 0, 0, 0};
  const uint64_t cuts[] = {0, 3, 1024, 4999, n};
  for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
    ASSERT_TRUE((*node)
                    ->GradientRange(2, x, absl::MakeSpan(pieces), cuts[c],
                                    cuts[c + 1], lanes)
                    .ok());
  }
  EXPECT_EQ(std::memcmp(pieces.data(), whole.data(), 4 * n), 0);
  EXPECT_NEAR((lanes[0] + lanes[1] + (lanes[2] + lanes[3])) / n, *loss,
              1e-12 * *loss);
  // A local rank's refusal names it.
  const absl::Status bad =
      (*node)->GradientRange(2, x, absl::MakeSpan(pieces), 9, 8, lanes);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("local rank 0 of 3"), std::string::npos)
      << bad.message();
}

TEST(SyntheticWorkloadTest, LocalRanksOutOfReachAreRefused) {
  for (const char* config :
       {"workers: 2 local_ranks: 40000 shards: 1 synthetic { dim: 10 } "
        "lr { lr: 0.1 } steps: 3 freeze_step: 1",
        "workers: 2 local_ranks: 2 shards: 1 external { dim: 10 } "
        "lr { lr: 0.1 } steps: 3 freeze_step: 1"}) {
    auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument)
        << config;
    EXPECT_NE(job.status().message().find("local_ranks"), std::string::npos)
        << job.status();
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
