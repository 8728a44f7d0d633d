// zero_one_adam (design.md 2.7) against independent oracles: its schedule
// against DeepSpeed's counters, and the simulator against the algorithm
// written out here element by element (lossless fp32 messages, so every
// worker's x and m and the shared v must match bit for bit through variance
// steps, compressed steps, local steps and syncs).
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "compress/compute_pool.h"
#include "compress/layout.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

// DeepSpeed's ZeroOneAdam counters, stepped once per 1-based step s: the
// variance steps (var_interval, var_counter) and, after the freeze, the
// local-step interval (local_step_interval, local_step_counter).
struct DeepSpeedCounters {
  int64_t kappa, freeze, scaler, clipper;
  int64_t var_interval = 1, var_counter = 0, local_interval = 1,
          local_counter = 0, s = 0;
  int64_t variance_updates = 0;

  // Returns {is a variance step, is a sync} of the next step.
  std::pair<bool, bool> Next() {
    ++s;
    if (s <= freeze) {
      const bool variance = s % var_interval == 0;
      if (variance) {
        ++variance_updates;
        if (++var_counter == kappa) {
          var_counter = 0;
          var_interval *= 2;
        }
      }
      return {variance, true};
    }
    const bool sync = s % local_interval == 0;
    if (++local_counter == scaler) {
      local_counter = 0;
      local_interval = std::min(clipper, local_interval * 2);
    }
    return {false, sync};
  }
};

AlgorithmConfig ZeroOneConfig(int64_t freeze, int64_t kappa, int64_t scaler,
                              int64_t clipper) {
  AlgorithmConfig c;
  c.optimizer = OptimizerKind::kZeroOneAdam;
  c.zero_one = {freeze, kappa, scaler, clipper};
  return c;
}

TEST(ZeroOneTest, TheScheduleIsDeepSpeedsCounters) {
  for (const auto& [freeze, kappa, scaler, clipper] :
       std::vector<std::array<int64_t, 4>>{{200, 3, 5, 8},
                                           {100000, 16, 32678, 16},
                                           {50, 1, 1, 3},
                                           {1, 2, 4, 16}}) {
    const AlgorithmConfig config =
        ZeroOneConfig(freeze, kappa, scaler, clipper);
    DeepSpeedCounters ds{kappa, freeze, scaler, clipper};
    const int64_t steps = std::min<int64_t>(freeze + 400, 120000);
    for (int64_t t = 0; t < steps; ++t) {
      const auto [variance, sync] = ds.Next();
      const ZeroOneStep z = ZeroOneAt(config, t);
      ASSERT_EQ(z.variance, variance) << "step " << t << " F " << freeze;
      ASSERT_EQ(z.exchanges, sync) << "step " << t << " F " << freeze;
      ASSERT_EQ(z.local, t >= freeze) << "step " << t;
      ASSERT_EQ(z.variance_updates, ds.variance_updates) << "step " << t;
      ASSERT_EQ(NextExchange(config, t) == t, sync);
    }
  }
}

// The workers' betas and eps (StepHyper moments: a scheduler that cycles
// the momentum, groups with their own) govern every phase of zero_one_adam
// (design.md 2.7): a variance step's Adam, a 1-bit step's local momentum,
// v's correction 1 - b2^n_v and the bound, a local step's scalars and a
// sync's message.
TEST(ZeroOneTest, TheWorkersBetasGovernEveryPhase) {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/10, /*kappa=*/2, /*scaler=*/3, /*clipper=*/4);
  const StepHyper hyper{0.02f, 0.0f, StepMoments{0.8f, 0.99f, 1e-6f}};
  ASSERT_TRUE(CheckStepHyper(c, hyper).ok());
  AdamHyper own = c.adam;
  own.beta1 = 0.8f;
  own.beta2 = 0.99f;
  own.eps = 1e-6f;
  // 0: variance, 2: 1-bit, 11: local, 10: sync.
  for (int64_t step : {0, 2, 11, 10}) {
    const StepPlan plan = PlanStep(c, step);
    const float correction =
        MakeAdamScalars(own, 0.0f, ZeroOneAt(c, step).variance_updates, true)
            .bias_correction2;
    ASSERT_NE(
        correction,
        MakeAdamScalars(c.adam, 0.0f, ZeroOneAt(c, step).variance_updates, true)
            .bias_correction2);
    const SendRule send = PlanSend(c, step, Direction::kUp, 0, 0, &hyper);
    EXPECT_EQ(send.beta1, 0.8f) << step;
    if (plan.local) {
      const AdamScalars local = LocalStepScalars(c, step, &hyper);
      EXPECT_EQ(local.beta1, 0.8f);
      EXPECT_EQ(local.beta2, 0.99f);
      EXPECT_EQ(local.eps, 1e-6f);
      EXPECT_EQ(local.bias_correction2, correction) << step;
      EXPECT_EQ(local.max_ratio, OneBitUpdateBound(own));
      EXPECT_EQ(send.accumulated, plan.exchanges);
      if (plan.exchanges) {
        EXPECT_EQ(send.sync.eps, 1e-6f);
        EXPECT_EQ(send.sync.bias_correction2, correction);
      }
      if (!plan.exchanges) continue;
    }
    const ReplyRule rule = PlanReply(c, step, &hyper);
    EXPECT_EQ(rule.scalars.beta1, 0.8f) << step;
    EXPECT_EQ(rule.scalars.beta2, 0.99f) << step;
    EXPECT_EQ(rule.scalars.eps, 1e-6f) << step;
    EXPECT_EQ(rule.scalars.bias_correction2, correction) << step;
    EXPECT_EQ(rule.scalars.max_ratio, OneBitUpdateBound(own)) << step;
  }
  EXPECT_NE(OneBitUpdateBound(own), OneBitUpdateBound(c.adam));
  // diloco takes the job's: refused there.
  c.optimizer = OptimizerKind::kDiloco;
  EXPECT_EQ(CheckStepHyper(c, hyper).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ZeroOneTest, PlansFollowThePhases) {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/10, /*kappa=*/2, /*scaler=*/3, /*clipper=*/4);
  // Variance steps s = t + 1 = 1, 2, 4, 6, 8; local from t = 10 with
  // interval 1 (t = 10..12), then 2 (t = 13..15: s = 14 and 16 sync), then 4.
  EXPECT_FALSE(PlanStep(c, 0).compressing);
  EXPECT_FALSE(PlanStep(c, 1).compressing);
  EXPECT_TRUE(PlanStep(c, 2).compressing);
  EXPECT_TRUE(PlanSend(c, 2, Direction::kUp, 0, 0).local_momentum);
  EXPECT_FALSE(PlanStep(c, 3).compressing);
  EXPECT_TRUE(PlanStep(c, 10).local && PlanStep(c, 10).exchanges);
  EXPECT_TRUE(PlanSend(c, 10, Direction::kUp, 0, 0).accumulated);
  EXPECT_FALSE(PlanSend(c, 10, Direction::kDown, 2, 0).accumulated);
  EXPECT_TRUE(PlanReply(c, 10).sync);
  EXPECT_TRUE(PlanStep(c, 12).exchanges && PlanStep(c, 13).exchanges);
  EXPECT_FALSE(PlanStep(c, 14).exchanges);
  EXPECT_TRUE(PlanStep(c, 15).exchanges);
  EXPECT_EQ(NextExchange(c, 14), 15);
  EXPECT_TRUE(StartsInterval(c, 10));
  EXPECT_TRUE(StartsInterval(c, 14));
  EXPECT_FALSE(StartsInterval(c, 15));
  EXPECT_FALSE(StartsInterval(c, 9));
  c.lr.base_lr = 0.5f;
  EXPECT_EQ(IntervalLrSum(c, 15), 1.0f);
  EXPECT_EQ(PlanReply(c, 15).scalars.lr, 1.0f);
  StepHyper hyper{0.25f, 0.0f};
  EXPECT_EQ(PlanReply(c, 15, &hyper).scalars.lr,
            0.25f);  // the pushes carry the sum
}

// A variance step after 1-bit steps: m holds the compressed replies'
// momentum while v holds only the variance steps' squared gradients, so
// Adam's ratio m/sqrt(v) is unbounded where v is tiny. It is clamped to
// 2.1's bound, as in every other step of the optimizer; bound_update off
// leaves Adam's step.
TEST(ZeroOneTest, AVarianceStepIsBoundedLikeTheOneBitSteps) {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/10, /*kappa=*/2, /*scaler=*/3, /*clipper=*/4);
  c.bias_correction = false;
  c.adam.weight_decay = 0.0f;
  const float bound = OneBitUpdateBound(c.adam);
  for (bool bounded : {true, false}) {
    c.bound_update = bounded;
    const ReplyRule rule =
        PlanReply(c, 3);  // s = 4: a variance step after s = 3's 1-bit step
    ASSERT_FALSE(rule.frozen_variance);
    EXPECT_EQ(rule.bounded_variance, bounded);
    std::vector<float> g = {0.0f, 1e-3f}, x = {0.0f, 0.0f}, m = {1.0f, 1e-3f},
                       v = {1e-12f, 1.0f};
    ApplyRule(rule, absl::MakeSpan(g), absl::MakeSpan(x), absl::MakeSpan(m),
              absl::MakeSpan(v), {}, {});
    const float lr = rule.scalars.lr;
    if (bounded) {
      EXPECT_EQ(x[0], 0.0f - lr * bound);  // clamped
    } else {
      EXPECT_LT(x[0], -1000.0f * lr);  // about lr * 0.9 / sqrt(0.999e-12)
    }
    // Within Adam's own bound nothing changes.
    const float m1 = c.adam.beta1 * 1e-3f + (1.0f - c.adam.beta1) * 1e-3f;
    const float v1 =
        c.adam.beta2 * 1.0f + (1.0f - c.adam.beta2) * (1e-3f * 1e-3f);
    EXPECT_EQ(x[1], 0.0f - lr * (m1 / (std::sqrt(v1) + c.adam.eps)));
  }
}

// The algorithm of design.md 2.7 written out with lossless messages. With
// `hypers` (one per parameter group, the layout's segments), each element
// takes its group's lr and weight_decay, and each group's sync its own
// interval's lr sum; without, the job's.
class Reference {
 public:
  Reference(const AlgorithmConfig& c, absl::Span<const float> x0)
      : c_(c),
        x_(x0.begin(), x0.end()),
        m_(x0.size()),
        v_(x0.size()),
        wx_(c.workers, x_),
        wm_(c.workers, m_),
        wu_(c.workers, std::vector<float>(x0.size())),
        segment_(x0.size()),
        lr_sum_(c.layout.cuts.size() + 1),
        ds_{c.zero_one.var_update_scaler, c.zero_one.var_freeze_step,
            c.zero_one.local_step_scaler, c.zero_one.local_step_clipper} {
    for (size_t j = 0; j < x0.size(); ++j) {
      for (uint64_t cut : c.layout.cuts) segment_[j] += j >= cut;
    }
  }

  void Step(const std::vector<std::vector<float>>& g,
            const std::vector<StepHyper>& hypers = {}) {
    const auto [variance, sync] = ds_.Next();
    const int64_t s = ds_.s;
    const float b1 = c_.adam.beta1, b2 = c_.adam.beta2, eps = c_.adam.eps;
    const auto hyper = [&](size_t j) {
      if (hypers.empty()) return StepHyper{c_.lr.base_lr, c_.adam.weight_decay};
      return hypers[hypers.size() == 1 ? 0 : segment_[j]];
    };
    const float bc1 = static_cast<float>(1.0 - std::pow(double{b1}, double(s)));
    const float bc2 = static_cast<float>(
        1.0 - std::pow(double{b2}, double(ds_.variance_updates)));
    const float bound = OneBitUpdateBound(c_.adam);
    const size_t n = x_.size();
    const uint32_t workers = c_.workers;
    const auto average = [&](const std::vector<std::vector<float>>& values,
                             size_t j) {
      float sum = 0.0f;
      for (uint32_t i = 0; i < workers; ++i) sum += values[i][j];
      return sum / static_cast<float>(workers);
    };
    const auto clamp = [&](float r) {
      return r > bound ? bound : (r < -bound ? -bound : r);
    };
    if (s <= c_.zero_one.var_freeze_step) {
      std::vector<std::vector<float>> sent = g;
      if (!variance) {  // local momenta, masked where v is 0
        for (uint32_t i = 0; i < workers; ++i) {
          for (size_t j = 0; j < n; ++j)
            sent[i][j] =
                v_[j] == 0.0f ? 0.0f : b1 * m_[j] + (1.0f - b1) * g[i][j];
        }
      }
      for (size_t j = 0; j < n; ++j) {
        const float a = average(sent, j);
        const float lr = hyper(j).lr, wd = hyper(j).weight_decay;
        if (variance) {
          m_[j] = b1 * m_[j] + (1.0f - b1) * a;
          v_[j] = b2 * v_[j] + (1.0f - b2) * (a * a);
          x_[j] = x_[j] -
                  lr * (clamp((m_[j] / bc1) / (std::sqrt(v_[j] / bc2) + eps)) +
                        wd * x_[j]);
        } else {
          m_[j] = a;
          x_[j] =
              x_[j] - lr * (clamp((a / bc1) / (std::sqrt(v_[j] / bc2) + eps)) +
                            wd * x_[j]);
        }
      }
      for (uint32_t i = 0; i < workers; ++i) wx_[i] = x_, wm_[i] = m_;
      return;
    }
    if (starts_) {
      for (uint32_t i = 0; i < workers; ++i)
        wx_[i] = x_, wm_[i] = m_, wu_[i].assign(n, 0.0f);
      std::fill(lr_sum_.begin(), lr_sum_.end(), 0.0f);
    }
    for (uint32_t i = 0; i < workers; ++i) {
      for (size_t j = 0; j < n; ++j) {
        const float lr = hyper(j).lr, wd = hyper(j).weight_decay;
        wm_[i][j] = b1 * wm_[i][j] + (1.0f - b1) * g[i][j];
        const float d =
            clamp(wm_[i][j] / (std::sqrt(v_[j] / bc2) + eps)) + wd * wx_[i][j];
        wu_[i][j] = wu_[i][j] + lr * d;
        if (!sync) wx_[i][j] = wx_[i][j] - lr * d;
      }
    }
    for (size_t k = 0; k < lr_sum_.size(); ++k) {
      const uint64_t first = k == 0 ? 0 : c_.layout.cuts[k - 1];
      lr_sum_[k] += hyper(first).lr;
    }
    starts_ = sync;
    if (!sync) return;
    std::vector<std::vector<float>> sent(workers, std::vector<float>(n));
    for (uint32_t i = 0; i < workers; ++i) {
      for (size_t j = 0; j < n; ++j) {
        sent[i][j] = v_[j] == 0.0f
                         ? 0.0f
                         : (wu_[i][j] * (std::sqrt(v_[j] / bc2) + eps)) /
                               lr_sum_[segment_[j]];
      }
    }
    for (size_t j = 0; j < n; ++j) {
      const float w = average(sent, j);
      x_[j] = x_[j] -
              lr_sum_[segment_[j]] * clamp(w / (std::sqrt(v_[j] / bc2) + eps));
      m_[j] = w;
    }
    for (uint32_t i = 0; i < workers; ++i) wx_[i] = x_, wm_[i] = m_;
  }

  const std::vector<float>& x(uint32_t i) const { return wx_[i]; }
  const std::vector<float>& m(uint32_t i) const { return wm_[i]; }
  const std::vector<float>& v() const { return v_; }
  const std::vector<float>& shared_x() const { return x_; }

 private:
  AlgorithmConfig c_;
  std::vector<float> x_, m_, v_;
  std::vector<std::vector<float>> wx_, wm_, wu_;
  std::vector<uint32_t> segment_;  // each element's parameter group
  std::vector<float> lr_sum_;      // each group's, this interval
  DeepSpeedCounters ds_;
  bool starts_ = true;
};

using testing::SameBits;

AlgorithmConfig WrittenOutConfig() {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/30, /*kappa=*/3, /*scaler=*/4, /*clipper=*/4);
  c.workers = 3;
  c.layout = {700, /*shards=*/2, /*block_elems=*/64, /*partition_elems=*/128};
  c.warmup_codec = c.up_codec = c.down_codec = CodecSpec{CodecKind::kFp32, 64};
  c.worker_feedback = c.server_feedback = FeedbackSpec{FeedbackKind::kEf};
  c.lr.base_lr = 0.01f;
  c.adam.weight_decay = 0.01f;
  return c;
}

// 80 steps of the simulator and the Reference from the same gradients, the
// step's `hypers_at` given to both: every worker's x and m, v and the
// shards' x bit-identical after every step. Returns the final x.
std::vector<float> ExpectTheAlgorithmWrittenOut(
    const AlgorithmConfig& c,
    std::function<std::vector<StepHyper>(int64_t)> hypers_at = nullptr) {
  const size_t dim = c.layout.dim;
  std::vector<float> x0(dim), a(dim), target(dim);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t j = 0; j < dim; ++j)
    x0[j] = uniform(rng), a[j] = 0.5f + 0.5f * uniform(rng),
    target[j] = uniform(rng);
  auto sim = Simulator::Create(c, x0);
  EXPECT_TRUE(sim.ok()) << sim.status();
  if (!sim.ok()) return {};
  Reference ref(c, x0);
  int64_t local_steps = 0, syncs = 0;
  for (int64_t t = 0; t < 80; ++t) {
    std::vector<std::vector<float>> g(c.workers, std::vector<float>(dim));
    for (uint32_t i = 0; i < c.workers; ++i) {
      std::mt19937 noise(static_cast<uint32_t>(1000 * t + i));
      std::normal_distribution<float> normal(0.0f, 0.3f);
      const auto x = sim->worker_x(i);
      for (size_t j = 0; j < dim; ++j) {
        g[i][j] = j % 7 == 0 ? 0.0f
                             : a[j] * (x[j] - target[j]) +
                                   normal(noise);  // j % 7: dead, v = 0
      }
    }
    const std::vector<StepHyper> hypers =
        hypers_at ? hypers_at(t) : std::vector<StepHyper>();
    std::vector<absl::Span<const float>> views(g.begin(), g.end());
    const StepPlan plan = PlanStep(c, t);
    local_steps += plan.local && !plan.exchanges;
    syncs += plan.local && plan.exchanges;
    const absl::Status stepped = sim->Step(views, hypers);
    EXPECT_TRUE(stepped.ok()) << stepped;
    if (!stepped.ok()) return {};
    ref.Step(g, hypers);
    for (uint32_t i = 0; i < c.workers; ++i) {
      EXPECT_TRUE(SameBits(sim->worker_x(i), ref.x(i)))
          << "worker " << i << " x at step " << t;
      EXPECT_TRUE(SameBits(sim->worker_m(i), ref.m(i)))
          << "worker " << i << " m at step " << t;
    }
    EXPECT_TRUE(SameBits(sim->v(), ref.v())) << "v at step " << t;
    EXPECT_TRUE(SameBits(sim->x(), ref.shared_x())) << "shared x at step " << t;
    if (::testing::Test::HasFailure()) return {};
    if (plan.local && !plan.exchanges) {
      EXPECT_FALSE(SameBits(sim->worker_x(0), sim->worker_x(1)))
          << "workers step on their own";
    }
  }
  EXPECT_GT(local_steps, 20);
  EXPECT_GT(syncs, 10);
  return std::vector<float>(sim->x().begin(), sim->x().end());
}

TEST(ZeroOneTest, TheSimulatorIsTheAlgorithmWrittenOut) {
  ExpectTheAlgorithmWrittenOut(WrittenOutConfig());
}

// Three parameter groups (segments of 192, 256 and 252 elements: the first
// on shard 0, the middle across both shards, the last on shard 1) with
// their own lr and weight_decay, changed every step as a scheduler
// would, the middle group without decay: every phase, local steps and each
// group's interval lr sum included, is the written-out algorithm's with
// each element's group's values.
TEST(ZeroOneTest, GroupsStepWithTheirOwnLrAndWeightDecay) {
  AlgorithmConfig c = WrittenOutConfig();
  c.layout.cuts = {192, 448};
  const auto hypers_at = [](int64_t t) {
    const float scale = 1.0f + 0.2f * std::sin(0.3f * static_cast<float>(t));
    return std::vector<StepHyper>{
        {0.01f * scale, 0.01f}, {0.02f * scale, 0.0f}, {0.005f / scale, 0.05f}};
  };
  const std::vector<float> grouped = ExpectTheAlgorithmWrittenOut(c, hypers_at);
  ASSERT_FALSE(grouped.empty());
  // The groups' values matter: one value for the whole model ends elsewhere.
  const std::vector<float> one = ExpectTheAlgorithmWrittenOut(
      c, [&](int64_t t) { return std::vector<StepHyper>{hypers_at(t)[0]}; });
  EXPECT_FALSE(SameBits(grouped, one));
  // Two values for three groups: refused, nothing changed.
  std::vector<float> x0(c.layout.dim, 0.5f);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok());
  std::vector<float> g(c.layout.dim, 0.1f);
  std::vector<absl::Span<const float>> views(c.workers, g);
  const std::vector<StepHyper> two(2, StepHyper{0.01f, 0.0f});
  EXPECT_EQ(sim->Step(views, two).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(sim->x(), x0));
}

TEST(ZeroOneTest,
     AWorkerReplicaMatchesTheSimulatorAndRefusesAnIntervalItDidNotStart) {
  constexpr size_t kDim = 300;
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/4, /*kappa=*/1, /*scaler=*/1, /*clipper=*/4);
  c.workers = 1;
  c.layout = {kDim, 1, 64, 128};
  c.warmup_codec = CodecSpec{CodecKind::kFp32, 64};
  c.up_codec = c.down_codec = CodecSpec{CodecKind::kSign1, 64};
  c.worker_feedback = c.server_feedback = FeedbackSpec{FeedbackKind::kEf};
  c.lr.base_lr = 0.01f;
  // Intervals 1, 2, then 4 from t = 6: t = 7 syncs (s = 8), t = 8 starts
  // an interval, t = 9 is in its middle.
  EXPECT_TRUE(PlanStep(c, 7).exchanges);
  EXPECT_TRUE(StartsInterval(c, 8));
  EXPECT_FALSE(PlanStep(c, 9).exchanges || StartsInterval(c, 9));
  Replica replica(c, {0, kDim});
  std::vector<float> g(kDim, 0.5f);
  absl::Status s = replica.LocalStep(9, g);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(replica.LocalStep(2, g).code(),
            absl::StatusCode::kFailedPrecondition);  // not local
}

// A worker's replica (LocalStep, or a sync's local step by partition, then
// SyncMessage and ApplyReply) and the shards' mirrors (ApplyReply of each
// partition with its group's push values: at a sync, the group's interval
// lr sum) give the simulator's bits with three parameter groups, through
// variance, compression, local and sync steps; two of the groups with
// betas and eps of their own, the first's beta1 changed every step (a
// scheduler that cycles the momentum). One worker with fp32 both ways: the
// reply is its message.
TEST(ZeroOneTest, WithGroupsAWorkerAndShardMirrorsGiveTheSimulatorsBits) {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/6, /*kappa=*/2, /*scaler=*/2, /*clipper=*/4);
  c.workers = 1;
  c.layout = {700, /*shards=*/2, /*block_elems=*/64, /*partition_elems=*/128,
              /*cuts=*/{192, 448}};
  c.warmup_codec = c.up_codec = c.down_codec = CodecSpec{CodecKind::kFp32, 64};
  c.adam.weight_decay = 0.01f;
  const size_t dim = c.layout.dim;
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  std::vector<float> x0(dim);
  for (size_t j = 0; j < dim; ++j) x0[j] = std::sin(0.1f * j);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok());
  testing::Replicas replicas = testing::ReplicasFrom(c, *layout, x0);
  Replica& worker = replicas.worker;
  const std::vector<Replica>& mirrors = replicas.mirrors;
  ComputePool pool(2);
  int64_t local_steps = 0, syncs = 0;
  for (int64_t t = 0; t < 30; ++t) {
    const float scale = 1.0f + 0.2f * std::sin(0.7f * static_cast<float>(t));
    const float beta1 = 0.85f + 0.004f * static_cast<float>(t % 7);
    std::vector<StepHyper> hypers{
        {0.01f * scale, 0.01f, StepMoments{beta1, 0.99f, 1e-6f}},
        {0.02f * scale, 0.0f, StepMoments{0.9f, 0.999f, 1e-8f}},
        {0.004f, 0.05f, StepMoments{0.8f, 0.98f, 1e-7f}}};
    std::vector<float> g(dim);
    for (size_t j = 0; j < dim; ++j)
      g[j] = j % 7 == 0 ? 0.0f : std::cos(0.01f * j * (t + 1)) + worker.x()[j];
    const StepPlan plan = PlanStep(c, t);
    std::vector<float> message(dim);
    std::vector<StepHyper> pushed = hypers;  // what the pushes carry
    if (plan.local) {
      if (t % 2 == 1 && plan.exchanges) {
        // As a CPU worker's encode: the sync's local step by partition.
        ASSERT_TRUE(worker.BeginSyncLocalStep(t, hypers).ok());
        for (const Partition& p : layout->partitions()) {
          ASSERT_TRUE(worker
                          .LocalStepRange(t, p.range.begin,
                                          absl::MakeConstSpan(g).subspan(
                                              p.range.begin, p.range.size()))
                          .ok());
        }
      } else {
        ASSERT_TRUE(worker.LocalStep(t, g, hypers, 1.0f, &pool).ok());
      }
      ++(plan.exchanges ? syncs : local_steps);
      if (plan.exchanges) {
        // Each partition's with its group's eps and v correction.
        for (const Partition& p : layout->partitions()) {
          const SendRule up = PlanSend(c, t, Direction::kUp, 0, p.range.begin,
                                       &hypers[p.segment]);
          ASSERT_TRUE(up.accumulated);
          worker.SyncMessage(
              t, up.sync, p.range.begin,
              absl::MakeSpan(message).subspan(p.range.begin, p.range.size()));
        }
        for (size_t k = 0; k < pushed.size(); ++k)
          pushed[k].lr = worker.lr_sums()[k];
      }
    } else if (plan.compressing) {
      for (const Partition& p : layout->partitions()) {
        worker.LocalMomentum(
            hypers[p.segment].moments->beta1, p.range.begin,
            absl::MakeConstSpan(g).subspan(p.range.begin, p.range.size()),
            absl::MakeSpan(message).subspan(p.range.begin, p.range.size()));
      }
    } else {
      message = g;
    }
    if (plan.exchanges) {
      for (size_t j = 0; j < dim; ++j)
        message[j] =
            worker.v()[j] == 0.0f && plan.compressing ? 0.0f : message[j];
      ASSERT_TRUE(testing::ApplyToWorkerAndMirrors(replicas, *layout, t,
                                                   message, pushed)
                      .ok());
    }
    std::vector<absl::Span<const float>> views{g};
    ASSERT_TRUE(sim->Step(views, hypers).ok());
    ASSERT_TRUE(SameBits(worker.x(), sim->worker_x(0)))
        << "worker x at step " << t;
    ASSERT_TRUE(SameBits(worker.m(), sim->worker_m(0)))
        << "worker m at step " << t;
    if (!plan.exchanges) continue;
    for (uint32_t s = 0; s < c.layout.shards; ++s) {
      const Range r = layout->shard_range(s);
      ASSERT_TRUE(SameBits(mirrors[s].x(), sim->x().subspan(r.begin, r.size())))
          << "shard " << s << " step " << t;
      ASSERT_TRUE(
          SameBits(mirrors[s].m(), sim->m().subspan(r.begin, r.size())));
    }
  }
  EXPECT_GT(local_steps, 5);
  EXPECT_GT(syncs, 5);
  // The interval's sums differ by group, and a count of hypers that is
  // neither one nor one per group changes nothing.
  EXPECT_NE(worker.lr_sums()[0], worker.lr_sums()[1]);
  const std::vector<float> x(worker.x().begin(), worker.x().end());
  const std::vector<StepHyper> two(2, StepHyper{0.01f, 0.0f});
  std::vector<float> g(dim, 0.1f);
  EXPECT_EQ(worker.LocalStep(30, g, two).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(worker.x(), x));
  // The interval as a worker's checkpoint keeps it (the optimizer's
  // IntervalState, by name): one sum per group, and another count, an
  // anchor without its u or an array missing is refused, changing nothing.
  const std::vector<NamedState> interval = worker.SaveInterval();
  ASSERT_EQ(interval.size(), 3u);
  EXPECT_EQ(interval[0].name, "anchor");
  EXPECT_EQ(interval[1].name, "u");
  EXPECT_EQ(interval[1].values.size(), interval[0].values.size());
  ASSERT_EQ(interval[2].name, "lr_sum");
  ASSERT_EQ(interval[2].values.size(), 3u);
  Replica restored(c, {0, dim});
  std::vector<NamedState> one = interval;
  one[2].values.resize(1);
  EXPECT_EQ(restored.RestoreInterval(one, worker.last_local_step()).code(),
            absl::StatusCode::kInvalidArgument);
  if (!interval[0].values.empty()) {
    std::vector<NamedState> no_u = interval;
    no_u[1].values.clear();
    EXPECT_EQ(restored.RestoreInterval(no_u, worker.last_local_step()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(restored
                .RestoreInterval(absl::MakeConstSpan(interval).subspan(1),
                                 worker.last_local_step())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(restored.last_local_step(), -1);
  ASSERT_TRUE(
      restored.RestoreInterval(interval, worker.last_local_step()).ok());
  EXPECT_TRUE(SameBits(restored.lr_sums(), worker.lr_sums()));
  EXPECT_EQ(restored.last_local_step(), worker.last_local_step());
  const std::vector<NamedState> again = restored.SaveInterval();
  for (size_t i = 0; i < again.size(); ++i) {
    EXPECT_EQ(again[i].name, interval[i].name);
    EXPECT_TRUE(SameBits(again[i].values, interval[i].values)) << i;
  }
}

// A CPU worker runs a sync's local step a partition at a time inside its
// encode (BeginSyncLocalStep, LocalStepRange): the same x, m, u and message
// as LocalStep over the whole gradient, whatever the ranges' order; a step
// that does not sync, or a range without a begun step, changes nothing.
TEST(ZeroOneTest, ASyncsLocalStepByRangeGivesLocalStepsValues) {
  constexpr size_t kDim = 300;
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/4, /*kappa=*/1, /*scaler=*/1, /*clipper=*/4);
  c.workers = 1;
  c.layout = {kDim, 1, 64, 128};
  c.lr.base_lr = 0.01f;
  ASSERT_TRUE(
      StartsInterval(c, 8));  // an interval of 4 from t = 8: syncs at 11 and 15
  ASSERT_TRUE(PlanStep(c, 11).exchanges && PlanStep(c, 15).exchanges);
  Replica whole(c, {0, kDim}), by_range(c, {0, kDim});
  for (Replica* r : {&whole, &by_range}) {
    for (size_t j = 0; j < kDim; ++j) {
      r->x()[j] = std::sin(0.3f * j);
      r->mutable_m()[j] = 0.01f * std::cos(0.7f * j);
      r->mutable_v()[j] = j % 17 == 0 ? 0.0f : 1e-4f * (1 + j % 5);
    }
  }
  for (int64_t t = 8; t < 16; ++t) {
    std::vector<float> g(kDim);
    for (size_t j = 0; j < kDim; ++j) g[j] = std::cos(0.05f * j * (t + 1));
    ASSERT_TRUE(whole.LocalStep(t, g).ok());
    if (!PlanStep(c, t).exchanges) {
      // Not a sync: refused, nothing changed, and LocalStep as before.
      const std::vector<float> x(by_range.x().begin(), by_range.x().end());
      EXPECT_EQ(by_range.BeginSyncLocalStep(t).code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(by_range.LocalStepRange(t, 0, absl::MakeConstSpan(g).first(10))
                    .code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_TRUE(SameBits(by_range.x(), x));
      ASSERT_TRUE(by_range.LocalStep(t, g).ok());
    } else {
      const absl::Status begun = by_range.BeginSyncLocalStep(t);
      ASSERT_TRUE(begun.ok()) << begun;
      EXPECT_TRUE(SameBits(by_range.lr_sums(), whole.lr_sums()));
      EXPECT_TRUE(by_range.local_step_by_range(t));
      EXPECT_EQ(
          by_range.LocalStepRange(t, 200, absl::MakeConstSpan(g).first(101))
              .code(),
          absl::StatusCode::kInvalidArgument);
      const auto gs = absl::MakeConstSpan(g);
      ASSERT_TRUE(by_range.LocalStepRange(t, 128, gs.subspan(128)).ok());
      ASSERT_TRUE(by_range.LocalStepRange(t, 0, gs.first(128)).ok());
      std::vector<float> a(kDim), b(kDim);
      const AdamScalars s = LocalStepScalars(c, t, nullptr);
      whole.SyncMessage(t, s, 0, absl::MakeSpan(a));
      by_range.SyncMessage(t, s, 0, absl::MakeSpan(b));
      EXPECT_TRUE(SameBits(a, b)) << "message at step " << t;
    }
    ASSERT_TRUE(SameBits(whole.x(), by_range.x())) << "x at step " << t;
    ASSERT_TRUE(SameBits(whole.m(), by_range.m())) << "m at step " << t;
    EXPECT_TRUE(SameBits(whole.lr_sums(), by_range.lr_sums()));
  }
  EXPECT_FALSE(by_range.local_step_by_range(16));
}

// A group added mid-job (design.md 2.1 "A group that starts later", 2.7):
// kappa = 4, F = 8 gives variance steps t = 0-3, 5, 7 and 1-bit steps
// t = 4, 6 before the local phase; intervals of at most 2 from t = 8.
AlgorithmConfig AddedGroupConfig(uint64_t first, uint64_t second) {
  AlgorithmConfig c =
      ZeroOneConfig(/*freeze=*/8, /*kappa=*/4, /*scaler=*/2, /*clipper=*/2);
  c.workers = 2;
  c.layout = {first + second, 2, 64, 128, {first}};
  c.warmup_codec = CodecSpec{CodecKind::kFp32, 64};
  c.up_codec = c.down_codec = CodecSpec{CodecKind::kSign1, 64};
  c.worker_feedback = c.server_feedback = FeedbackSpec{FeedbackKind::kEf};
  return c;
}

// Its corrections count its own updates from the first variance step at or
// after the step it was added (m from that step, n_v its own variance
// steps, frozen in the local phase at those before F); the steps before it
// take its first update's (finite: the segment is masked whole there). No
// variance step left before F, or a 1-bit step with the mask off: refused.
TEST(ZeroOneTest, AGroupAddedMidJobCountsFromItsFirstVarianceStep) {
  AlgorithmConfig c = AddedGroupConfig(256, 320);
  const auto expected = [](double beta, int64_t t) {
    return static_cast<float>(1.0 - std::pow(beta, t));
  };
  const double b1 = c.adam.beta1, b2 = c.adam.beta2;
  const StepHyper at_one_bit{0.01f, 0.0f, std::nullopt, /*first_step=*/4};
  ASSERT_TRUE(CheckStepHyper(c, at_one_bit).ok());
  EXPECT_EQ(*OptimizerOf(c).FirstCountedStep(c, 4), 5);
  EXPECT_EQ(*OptimizerOf(c).FirstCountedStep(c, 5), 5);
  // {step, m's updates, v's updates}
  for (const auto& [step, m_updates, v_updates] :
       std::vector<std::array<int64_t, 3>>{
           {4, 1, 1}, {5, 1, 1}, {6, 2, 1}, {7, 3, 2}}) {
    const ReplyRule rule = PlanReply(c, step, &at_one_bit);
    EXPECT_EQ(rule.scalars.bias_correction1, expected(b1, m_updates)) << step;
    EXPECT_EQ(rule.scalars.bias_correction2, expected(b2, v_updates)) << step;
  }
  for (int64_t step : {8, 9, 12}) {
    EXPECT_EQ(LocalStepScalars(c, step, &at_one_bit).bias_correction2,
              expected(b2, 2))
        << step;
  }
  EXPECT_EQ(PlanReply(c, 9, &at_one_bit).scalars.bias_correction2,
            expected(b2, 2));  // a sync's
  StepHyper late = at_one_bit;
  late.first_step = 8;  // the local phase
  absl::Status refused = CheckStepHyper(c, late);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("var_freeze_step 8"), std::string::npos)
      << refused;
  late.first_step = 7;  // the last variance step
  EXPECT_TRUE(CheckStepHyper(c, late).ok());
  c.zero_one.var_freeze_step = 7;  // t = 6's next variance step is past F
  late.first_step = 6;
  EXPECT_EQ(CheckStepHyper(c, late).code(), absl::StatusCode::kInvalidArgument);
  c.zero_one.var_freeze_step = 8;
  c.mask_zero_variance = false;
  refused = CheckStepHyper(c, at_one_bit);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("(step 5)"), std::string::npos) << refused;
  late.first_step = 5;  // a variance step needs no mask
  EXPECT_TRUE(CheckStepHyper(c, late).ok());
}

// Through whole steps, sign1 both ways with error feedback, 2 workers:
// (1) a second segment added at a variance step (k = 2) with no gradient
// and no weight decay before it trains bit for bit as a job of that segment
// alone whose schedule is the first job's shifted by k (kappa 2, F 6: its
// variance steps s' = 1, 2, 4, 6 are the first job's 3, 4, 6, 8, its
// intervals the same); (2) one added at a 1-bit step (k = 4) is held until
// its first variance step: it ends bit for bit as the same segment added at
// t = 5, its gradients at t = 4 moving nothing (every replica's and worker's
// x, m and v compared); with weight decay, t = 4 moves it by that alone.
TEST(ZeroOneTest, AGroupAddedMidJobTrainsAsTheScheduleSays) {
  constexpr uint64_t kFirst = 256, kSecond = 320;
  constexpr int64_t kSteps = 16;
  const AlgorithmConfig both = AddedGroupConfig(kFirst, kSecond);
  const auto grad = [](uint32_t i, int64_t step, size_t j) {
    return std::sin(0.1f * j + 0.7f * i + 0.3f * step) + 0.05f * i;
  };
  std::vector<float> x0(kFirst + kSecond);
  for (size_t j = 0; j < x0.size(); ++j) x0[j] = 0.01f * (j % 13) - 0.05f;
  // Runs the two-segment job, the second segment's gradients from step
  // `from` (those of its step - `shift`), its pushes saying first_step
  // `added` from then on (0 before), with weight decay `wd`.
  const auto run =
      [&](int64_t from, int64_t shift, int64_t added, float wd,
          const std::function<void(int64_t, const Simulator&)>& after_step) {
        auto sim = Simulator::Create(both, x0);
        ASSERT_TRUE(sim.ok()) << sim.status();
        for (int64_t step = 0; step < kSteps; ++step) {
          std::vector<std::vector<float>> g(
              both.workers, std::vector<float>(kFirst + kSecond));
          for (uint32_t i = 0; i < both.workers; ++i) {
            for (size_t j = 0; j < kFirst; ++j) g[i][j] = grad(i, step, j);
            for (size_t j = 0; step >= from && j < kSecond; ++j)
              g[i][kFirst + j] = grad(i + 5, step - shift, j);
          }
          std::vector<absl::Span<const float>> views(g.begin(), g.end());
          std::vector<StepHyper> hypers{StepHyper{0.01f, 0.0f},
                                        StepHyper{0.02f, wd}};
          if (step >= added) hypers[1].first_step = added;
          ASSERT_TRUE(sim->Step(views, hypers).ok()) << step;
          after_step(step, *sim);
        }
      };
  // (1) against a job of its own.
  AlgorithmConfig alone = both;
  alone.layout = {kSecond, 2, 64, 128, {}};
  alone.zero_one = {/*freeze=*/6, /*kappa=*/2, /*scaler=*/2, /*clipper=*/2};
  constexpr int64_t kAdded = 2;
  auto own = Simulator::Create(
      alone, absl::MakeConstSpan(x0).subspan(kFirst, kSecond));
  ASSERT_TRUE(own.ok()) << own.status();
  run(kAdded, kAdded, kAdded, 0.0f, [&](int64_t step, const Simulator& sim) {
    if (step < kAdded) {
      for (size_t j = 0; j < kSecond; ++j)
        ASSERT_EQ(sim.x()[kFirst + j], x0[kFirst + j]) << step;
      return;
    }
    ASSERT_EQ(PlanStep(both, step).compressing,
              PlanStep(alone, step - kAdded).compressing);
    ASSERT_EQ(PlanStep(both, step).exchanges,
              PlanStep(alone, step - kAdded).exchanges);
    std::vector<std::vector<float>> g(both.workers,
                                      std::vector<float>(kSecond));
    for (uint32_t i = 0; i < both.workers; ++i)
      for (size_t j = 0; j < kSecond; ++j)
        g[i][j] = grad(i + 5, step - kAdded, j);
    std::vector<absl::Span<const float>> views(g.begin(), g.end());
    ASSERT_TRUE(own->Step(views, {StepHyper{0.02f, 0.0f}}).ok());
    for (size_t j = 0; j < kSecond; ++j) {
      for (uint32_t i = 0; i < both.workers; ++i)
        ASSERT_EQ(sim.worker_x(i)[kFirst + j], own->worker_x(i)[j])
            << "step " << step << " worker " << i << " element " << j;
      ASSERT_EQ(sim.v()[kFirst + j], own->v()[j]) << step;
    }
  });
  // (2) added at the 1-bit step t = 4 against added at t = 5.
  const auto every_replica = [&](const Simulator& sim) {
    std::vector<float> all(sim.x().begin(), sim.x().end());
    all.insert(all.end(), sim.m().begin(), sim.m().end());
    all.insert(all.end(), sim.v().begin(), sim.v().end());
    for (uint32_t i = 0; i < both.workers; ++i) {
      all.insert(all.end(), sim.worker_x(i).begin(), sim.worker_x(i).end());
      all.insert(all.end(), sim.worker_m(i).begin(), sim.worker_m(i).end());
    }
    return all;
  };
  std::vector<std::vector<float>> at_five;
  run(5, 0, 5, 0.0f, [&](int64_t, const Simulator& sim) {
    at_five.push_back(every_replica(sim));
  });
  int64_t compared = 0;
  run(4, 0, 4, 0.0f, [&](int64_t step, const Simulator& sim) {
    ASSERT_TRUE(SameBits(every_replica(sim), at_five[step])) << "step " << step;
    ++compared;
  });
  EXPECT_EQ(compared, kSteps);
  // With weight decay, the held step moves the segment by it alone.
  constexpr float kWd = 0.5f;
  std::vector<float> before(kSecond);
  run(4, 0, 4, kWd, [&](int64_t step, const Simulator& sim) {
    const auto second = sim.x().subspan(kFirst, kSecond);
    if (step == 3) std::copy(second.begin(), second.end(), before.begin());
    if (step != 4) return;
    for (size_t j = 0; j < kSecond; ++j) {
      ASSERT_EQ(second[j], before[j] - 0.02f * (kWd * before[j])) << j;
      ASSERT_EQ(sim.v()[kFirst + j], 0.0f) << j;
    }
  });
}

}  // namespace
}  // namespace morse::compress
