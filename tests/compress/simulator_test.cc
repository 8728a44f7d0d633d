// The simulator against independent oracles: plain synchronous Adam written
// out here element by element, and Adam's loss on a noisy quadratic.
#include "compress/simulator.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "compress/clipping.h"
#include "compress/replica.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

// A noisy quadratic: f(x) = 0.5 sum_j a_j (x_j - t_j)^2; worker i sees the
// exact gradient plus its own Gaussian noise.
class NoisyQuadratic {
 public:
  NoisyQuadratic(size_t dim, uint32_t workers, float noise, uint32_t seed)
      : a_(dim), t_(dim), workers_(workers), noise_(noise), rng_(seed) {
    std::uniform_real_distribution<float> curvature(0.1f, 1.0f),
        target(-1.0f, 1.0f);
    for (size_t j = 0; j < dim; ++j) {
      a_[j] = curvature(rng_);
      t_[j] = target(rng_);
    }
  }

  std::vector<std::vector<float>> Gradients(absl::Span<const float> x) {
    std::normal_distribution<float> normal(0.0f, noise_);
    std::vector<std::vector<float>> g(workers_, std::vector<float>(x.size()));
    for (auto& gi : g) {
      for (size_t j = 0; j < x.size(); ++j)
        gi[j] = a_[j] * (x[j] - t_[j]) + normal(rng_);
    }
    return g;
  }

  double Loss(absl::Span<const float> x) const {
    double loss = 0.0;
    for (size_t j = 0; j < x.size(); ++j) {
      loss += 0.5 * a_[j] * double(x[j] - t_[j]) * double(x[j] - t_[j]);
    }
    return loss;
  }

 private:
  std::vector<float> a_, t_;
  uint32_t workers_;
  float noise_;
  std::mt19937 rng_;
};

absl::Status Step(Simulator& sim, const std::vector<std::vector<float>>& g) {
  std::vector<absl::Span<const float>> views(g.begin(), g.end());
  return sim.Step(views);
}

AlgorithmConfig BaseConfig(OptimizerKind optimizer, uint32_t workers,
                           uint64_t dim) {
  AlgorithmConfig c;
  c.optimizer = optimizer;
  c.workers = workers;
  c.layout = {dim, 2, 256, 1024};
  for (CodecSpec* codec : {&c.warmup_codec, &c.up_codec, &c.down_codec}) {
    codec->block_elems = 256;
  }
  return c;
}

TEST(SimulatorTest, Fp32AdamWithoutFeedbackIsExactSynchronousAdam) {
  const uint64_t dim = 3001;  // odd: last block and partition are short
  AlgorithmConfig c = BaseConfig(OptimizerKind::kAdam, 3, dim);
  c.up_codec.kind = c.down_codec.kind = CodecKind::kFp32;
  c.worker_feedback.kind = c.server_feedback.kind = FeedbackKind::kNone;
  c.adam = {0.9f, 0.999f, 1e-8f, 0.001f};
  c.lr = {LrSchedule::Kind::kConstant, 0.01f, 5};
  NoisyQuadratic problem(dim, 3, 0.1f, 1);
  std::vector<float> x0 = testing::VariedData(dim, 2);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok()) << sim.status();

  std::vector<float> x = x0, m(dim, 0.0f), v(dim, 0.0f);
  for (int t = 0; t < 20; ++t) {
    const auto g = problem.Gradients(x);
    ASSERT_TRUE(Step(*sim, g).ok());
    // The oracle: average in rank order, then Adam, written out.
    const float lr = LearningRate(c.lr, t);
    const float bc1 = static_cast<float>(1.0 - std::pow(double{0.9f}, t + 1));
    const float bc2 = static_cast<float>(1.0 - std::pow(double{0.999f}, t + 1));
    for (size_t j = 0; j < dim; ++j) {
      float sum = 0.0f;
      for (const auto& gi : g) sum += gi[j];
      const float avg = sum / 3.0f;
      m[j] = 0.9f * m[j] + (1.0f - 0.9f) * avg;
      v[j] = 0.999f * v[j] + (1.0f - 0.999f) * (avg * avg);
      const float step =
          (m[j] / bc1) / (std::sqrt(v[j] / bc2) + 1e-8f) + 0.001f * x[j];
      x[j] = x[j] - lr * step;
    }
    ASSERT_EQ(testing::FirstBitDifference(sim->x(), x), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(sim->m(), m), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(sim->v(), v), -1) << "step " << t;
  }
}

// clip_grad_norm on exact synchronous Adam: the averaged gradient is
// scaled by min(1, max_norm / (|avg| + 1e-6)) before m and v see it, |avg|
// being the sum of the partitions' sums of squares (what the shards send).
TEST(SimulatorTest, ClippingScalesTheAveragedGradientByItsGlobalNorm) {
  const uint64_t dim = 3001;
  AlgorithmConfig c = BaseConfig(OptimizerKind::kAdam, 3, dim);
  c.up_codec.kind = c.down_codec.kind = CodecKind::kFp32;
  c.worker_feedback.kind = c.server_feedback.kind = FeedbackKind::kNone;
  c.lr = {LrSchedule::Kind::kConstant, 0.01f, 5};
  c.clip_grad_norm = 2.0f;
  NoisyQuadratic problem(dim, 3, 0.1f, 1);
  std::vector<float> x0 = testing::VariedData(dim, 2);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok()) << sim.status();
  const Layout& layout = sim->layout();
  std::vector<float> x = x0, m(dim, 0.0f), v(dim, 0.0f), avg(dim);
  int clipped = 0;
  for (int t = 0; t < 10; ++t) {
    const auto g = problem.Gradients(x);
    ASSERT_TRUE(Step(*sim, g).ok());
    for (size_t j = 0; j < dim; ++j)
      avg[j] = ((g[0][j] + g[1][j]) + g[2][j]) / 3.0f;
    double sum_of_squares = 0;
    for (const Partition& p : layout.partitions()) {
      sum_of_squares += GradientSumOfSquares(
          absl::MakeConstSpan(avg).subspan(p.range.begin, p.range.size()));
    }
    const float scale = ClipScale(sum_of_squares, 2.0f);
    EXPECT_FLOAT_EQ(scale,
                    std::min(1.0, 2.0 / (std::sqrt(sum_of_squares) + 1e-6)));
    clipped += scale < 1.0f;
    const float bc1 = static_cast<float>(1.0 - std::pow(double{0.9f}, t + 1));
    const float bc2 = static_cast<float>(1.0 - std::pow(double{0.999f}, t + 1));
    for (size_t j = 0; j < dim; ++j) {
      const float a = avg[j] * scale;
      m[j] = 0.9f * m[j] + (1.0f - 0.9f) * a;
      v[j] = 0.999f * v[j] + (1.0f - 0.999f) * (a * a);
      x[j] = x[j] -
             LearningRate(c.lr, t) *
                 ((m[j] / bc1) / (std::sqrt(v[j] / bc2) + 1e-8f) + 0.0f * x[j]);
    }
    ASSERT_EQ(testing::FirstBitDifference(sim->x(), x), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(sim->m(), m), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(sim->v(), v), -1) << "step " << t;
  }
  EXPECT_GT(clipped, 5);  // the norm is above 2 for most steps
}

// 1-bit Adam with clipping: in warmup the (one worker's) averaged gradient,
// in the compression phase each worker's own gradient, is scaled before use,
// which is what an unclipped run fed the scaled gradients does, bit for bit.
// A huge max_norm never clips: the bits of no clipping at all.
TEST(SimulatorTest,
     OneBitAdamClipsTheAverageInWarmupAndEachWorkersOwnGradientAfter) {
  const uint64_t dim = 3001;
  AlgorithmConfig plain = BaseConfig(OptimizerKind::kOneBitAdam, 1, dim);
  plain.lr = {LrSchedule::Kind::kConstant, 0.01f, 5};
  plain.freeze_step = 3;
  AlgorithmConfig clipped = plain, huge = plain;
  clipped.clip_grad_norm = 1.5f;
  huge.clip_grad_norm = 1e30f;
  std::vector<float> x0 = testing::VariedData(dim, 2);
  auto a = Simulator::Create(clipped, x0), b = Simulator::Create(plain, x0);
  auto c = Simulator::Create(huge, x0), d = Simulator::Create(plain, x0);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  NoisyQuadratic problem(dim, 1, 0.1f, 5);
  for (int t = 0; t < 8; ++t) {
    auto g = problem.Gradients(a->x());
    ASSERT_TRUE(Step(*c, g).ok());
    ASSERT_TRUE(Step(*d, g).ok());
    ASSERT_TRUE(Step(*a, g).ok());
    const float scale = ClipScale(GradientSumOfSquares(g[0]), 1.5f);
    ASSERT_LT(scale, 1.0f) << "step " << t;
    for (float& gj : g[0]) gj *= scale;
    ASSERT_TRUE(Step(*b, g).ok());
    ASSERT_EQ(testing::FirstBitDifference(a->x(), b->x()), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(a->m(), b->m()), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(a->v(), b->v()), -1) << "step " << t;
    ASSERT_EQ(testing::FirstBitDifference(c->x(), d->x()), -1) << "step " << t;
  }
  EXPECT_NE(testing::FirstBitDifference(a->x(), d->x()), -1);
}

struct TrainResult {
  double initial_loss = 0, final_loss = 0;
};

TrainResult Train(const AlgorithmConfig& c, int steps) {
  NoisyQuadratic problem(c.layout.dim, c.workers, 0.5f, 3);
  std::vector<float> x0(c.layout.dim, 0.0f);
  auto sim = Simulator::Create(c, x0);
  EXPECT_TRUE(sim.ok()) << sim.status();
  TrainResult r{problem.Loss(sim->x()), 0};
  for (int t = 0; t < steps; ++t)
    EXPECT_TRUE(Step(*sim, problem.Gradients(sim->x())).ok());
  r.final_loss = problem.Loss(sim->x());
  return r;
}

// The norms of order 1 and infinity a worker's clip_grad_norm_ may take of
// the averaged gradient (design.md 2.6), as torch's vector_norm.
// A clip of part of the model: each element times its piece's scale, a
// partition's share of the pieces relative to its start, and the lists a
// shard refuses.
TEST(ClippingTest, PiecesScaleTheirOwnElements) {
  const ClipPieces pieces = {{3, 0.5f}, {7, 1.0f}, {10, 0.25f}};
  EXPECT_TRUE(ValidateClipPieces(pieces, 10).ok());
  EXPECT_TRUE(ValidateClipPieces({}, 10).ok());
  EXPECT_FALSE(ValidateClipPieces(pieces, 11).ok());  // short of the model
  EXPECT_FALSE(ValidateClipPieces({{3, 0.5f}, {3, 1.0f}, {10, 1.0f}}, 10).ok());
  EXPECT_FALSE(ValidateClipPieces({{0, 0.5f}, {10, 1.0f}}, 10).ok());
  // Any finite scale (an edit after the clip may double a gradient or
  // negate it), nothing else.
  EXPECT_TRUE(ValidateClipPieces({{10, -0.5f}}, 10).ok());
  EXPECT_TRUE(ValidateClipPieces({{10, 2.0f}}, 10).ok());
  EXPECT_FALSE(
      ValidateClipPieces({{10, std::numeric_limits<float>::infinity()}}, 10)
          .ok());
  EXPECT_FALSE(
      ValidateClipPieces({{10, std::numeric_limits<float>::quiet_NaN()}}, 10)
          .ok());
  const ClipPieces share = ClipPiecesOf(pieces, 2, 8);  // elements 2..7
  ASSERT_EQ(share.size(), 3u);
  EXPECT_EQ(share[0].end, 1u);
  EXPECT_EQ(share[1].end, 5u);
  EXPECT_EQ(share[2].end, 6u);
  EXPECT_EQ(share[2].scale, 0.25f);
  std::vector<float> values(6, 3.0f);  // elements 2..7 again
  // From element 1 of the share on (global 3): the first piece untouched.
  ScaleByPieces(share, 1, absl::MakeSpan(values).subspan(1));
  EXPECT_EQ(values, (std::vector<float>{3.0f, 3.0f, 3.0f, 3.0f, 3.0f, 0.75f}));
  ScaleByPieces(share, 0, absl::MakeSpan(values).first(1));
  EXPECT_EQ(values[0], 1.5f);
  EXPECT_TRUE(SameClipPieces(pieces, pieces));
  EXPECT_FALSE(SameClipPieces(pieces, share));
}

TEST(ClippingTest, OtherNormsAreTheSumAndTheLargestMagnitude) {
  const std::vector<float> values = {0.5f, -3.25f, 0.0f, 2.0f, -0.125f};
  const OtherNorms norms = GradientOtherNorms(values);
  EXPECT_EQ(norms.sum_abs, 5.875);
  EXPECT_EQ(norms.max_abs, 3.25f);
  EXPECT_EQ(GradientOtherNorms({}).sum_abs, 0.0);
  EXPECT_EQ(GradientOtherNorms({}).max_abs, 0.0f);
  // A NaN anywhere makes both NaN (std::max alone would drop one first).
  const std::vector<float> nan_first = {std::nanf(""), 1.0f};
  const std::vector<float> nan_last = {1.0f, std::nanf("")};
  for (const auto* v : {&nan_first, &nan_last}) {
    EXPECT_TRUE(std::isnan(GradientOtherNorms(*v).max_abs));
    EXPECT_TRUE(std::isnan(GradientOtherNorms(*v).sum_abs));
  }
  const std::vector<float> infinite = {1.0f, -INFINITY};
  EXPECT_EQ(GradientOtherNorms(infinite).max_abs, INFINITY);
}

// A shard takes every order in one pass (AllGradientNorms): the same bits
// as GradientSumOfSquares and GradientOtherNorms, at lengths that end
// inside a segment and inside a lane, with values whose sums depend on the
// order they are added in.
TEST(ClippingTest, AllNormsInOnePassAreEachNormsBits) {
  std::mt19937 rng(7);
  std::lognormal_distribution<float> magnitude(0.0f, 4.0f);
  for (uint64_t n : {0, 1, 7, 8, 255, 256, 257, 1000, 4099}) {
    std::vector<float> values(n);
    for (float& v : values) v = (rng() % 2 ? 1.0f : -1.0f) * magnitude(rng);
    const GradientNorms all = AllGradientNorms(values);
    const OtherNorms other = GradientOtherNorms(values);
    EXPECT_EQ(all.sum_of_squares, GradientSumOfSquares(values)) << n;
    EXPECT_EQ(all.other.sum_abs, other.sum_abs) << n;
    EXPECT_EQ(all.other.max_abs, other.max_abs) << n;
    if (n > 8) {  // and a NaN still makes both NaN
      values[n / 2] = std::nanf("");
      EXPECT_TRUE(std::isnan(AllGradientNorms(values).other.max_abs)) << n;
      EXPECT_TRUE(std::isnan(AllGradientNorms(values).sum_of_squares)) << n;
    }
  }
}

TEST(SimulatorTest, OneBitAdamReachesAdamsLossOnANoisyQuadratic) {
  const uint64_t dim = 4000;
  const int steps = 1000;
  AlgorithmConfig adam = BaseConfig(OptimizerKind::kAdam, 4, dim);
  adam.up_codec.kind = adam.down_codec.kind = CodecKind::kFp32;
  adam.worker_feedback.kind = adam.server_feedback.kind = FeedbackKind::kNone;
  adam.lr = {LrSchedule::Kind::kCosine, 0.02f, 0, steps, 0.0f};
  AlgorithmConfig onebit = BaseConfig(OptimizerKind::kOneBitAdam, 4, dim);
  onebit.lr = adam.lr;
  onebit.freeze_step = steps / 5;
  const TrainResult a = Train(adam, steps), b = Train(onebit, steps);
  std::printf(
      "noisy quadratic, %d steps: loss %.4g -> adam %.4g, onebit_adam %.4g\n",
      steps, a.initial_loss, a.final_loss, b.final_loss);
  // Both make real progress, and 1-bit Adam ends within 25% of Adam's loss
  // plus 0.1% of the starting loss (the gradient noise sets the floor).
  EXPECT_LT(a.final_loss, 0.01 * a.initial_loss);
  EXPECT_LT(b.final_loss, 1.25 * a.final_loss + 1e-3 * a.initial_loss);
}

TEST(SimulatorTest, OneBitAdamFreezesVAndSetsMomentumToTheServersSigns) {
  const uint64_t dim = 1500;
  AlgorithmConfig c = BaseConfig(OptimizerKind::kOneBitAdam, 2, dim);
  c.lr = {LrSchedule::Kind::kConstant, 0.01f};
  c.freeze_step = 3;
  NoisyQuadratic problem(dim, 2, 0.1f, 5);
  auto sim = Simulator::Create(c, std::vector<float>(dim, 0.0f));
  ASSERT_TRUE(sim.ok());
  std::vector<float> v_frozen;
  for (int t = 0; t < 8; ++t) {
    EXPECT_EQ(sim->compressing(), t >= 3);
    ASSERT_TRUE(Step(*sim, problem.Gradients(sim->x())).ok());
    if (t == 2) v_frozen.assign(sim->v().begin(), sim->v().end());
  }
  EXPECT_EQ(testing::FirstBitDifference(sim->v(), v_frozen), -1);
  // m is the decoded sign1 reply: one magnitude per 256-element block.
  for (size_t start = 0; start < dim; start += 256) {
    for (size_t j = start; j < std::min<size_t>(dim, start + 256); ++j) {
      ASSERT_EQ(std::fabs(sim->m()[j]), std::fabs(sim->m()[start])) << j;
    }
  }
  EXPECT_GT(sim->worker_error(0).SquaredNorm(), 0.0);
  EXPECT_GT(sim->server_error(1).SquaredNorm(), 0.0);
}

TEST(SimulatorTest, SameInputsGiveTheSameBits) {
  AlgorithmConfig c = BaseConfig(OptimizerKind::kAdam, 3, 2000);
  c.up_codec.kind = c.down_codec.kind = CodecKind::kInt4;
  c.up_codec.rounding = Rounding::kStochastic;
  c.worker_feedback = c.server_feedback = {FeedbackKind::kEma, 0.5f};
  c.seed = 99;
  std::vector<std::vector<float>> xs;
  for (int run = 0; run < 2; ++run) {
    NoisyQuadratic problem(2000, 3, 0.1f, 7);
    auto sim = Simulator::Create(c, std::vector<float>(2000, 0.0f));
    ASSERT_TRUE(sim.ok());
    for (int t = 0; t < 10; ++t)
      ASSERT_TRUE(Step(*sim, problem.Gradients(sim->x())).ok());
    xs.emplace_back(sim->x().begin(), sim->x().end());
  }
  EXPECT_EQ(testing::FirstBitDifference(xs[0], xs[1]), -1);
}

TEST(SimulatorTest, BadConfigsAndInputsAreRejected) {
  AlgorithmConfig c = BaseConfig(OptimizerKind::kOneBitAdam, 2, 1000);
  c.warmup_codec.kind = CodecKind::kSign1;
  EXPECT_EQ(Simulator::Create(c, std::vector<float>(1000)).status().code(),
            absl::StatusCode::kInvalidArgument);
  c = BaseConfig(OptimizerKind::kOneBitAdam, 2, 1000);
  c.up_codec.block_elems = 512;
  EXPECT_EQ(Simulator::Create(c, std::vector<float>(1000)).status().code(),
            absl::StatusCode::kInvalidArgument);
  c = BaseConfig(OptimizerKind::kOneBitAdam, 2, 1000);
  EXPECT_EQ(Simulator::Create(c, std::vector<float>(999)).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto sim = Simulator::Create(c, std::vector<float>(1000));
  ASSERT_TRUE(sim.ok());
  const std::vector<std::vector<float>> one(1, std::vector<float>(1000));
  EXPECT_EQ(Step(*sim, one).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<std::vector<float>> short_g(2, std::vector<float>(999));
  EXPECT_EQ(Step(*sim, short_g).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim->step(), 0);
}

}  // namespace
}  // namespace morse::compress
