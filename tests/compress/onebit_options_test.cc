// DESIGN 2.1's options of onebit_adam: bias correction, the zero-variance
// mask and the bounded update. Off, they reproduce the bits Morse computed
// before they existed (checksums recorded from that code, commit afe4479's
// compress/, with the inputs below); on, they do what 2.1 says.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/messages.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "compress/update_rules.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

constexpr uint64_t kDim = 1007;
constexpr int kSteps = 12;

AlgorithmConfig OneBitConfig() {
  AlgorithmConfig c;
  c.optimizer = OptimizerKind::kOneBitAdam;
  c.workers = 3;
  c.layout = {kDim, 2, 64, 256};
  c.lr.base_lr = 0.01f;
  c.freeze_step = 4;
  c.up_codec.block_elems = c.down_codec.block_elems =
      c.warmup_codec.block_elems = 64;
  return c;
}

// Element j % 5 == 0 never gets a gradient: its v stays exactly 0.
bool Dead(size_t j) { return j % 5 == 0; }

std::vector<std::vector<float>> Gradients(uint32_t workers, int step) {
  std::vector<std::vector<float>> g(workers, std::vector<float>(kDim));
  for (uint32_t i = 0; i < workers; ++i) {
    for (size_t j = 0; j < kDim; ++j) {
      g[i][j] = Dead(j) ? 0.0f : std::sin(0.1f * j + 0.7f * i + 0.3f * step);
    }
  }
  return g;
}

std::vector<float> X0() {
  std::vector<float> x0(kDim);
  for (size_t j = 0; j < kDim; ++j)
    x0[j] = 0.01f * static_cast<float>(j % 13) - 0.05f;
  return x0;
}

// Runs kSteps steps of gradients(workers, step); calls `after(step, sim)`
// after each.
template <class F, class G = decltype(&Gradients)>
void RunSteps(const AlgorithmConfig& c, F after, G gradients = &Gradients) {
  auto sim = Simulator::Create(c, X0());
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (int step = 0; step < kSteps; ++step) {
    const auto g = gradients(c.workers, step);
    std::vector<absl::Span<const float>> views(g.begin(), g.end());
    ASSERT_TRUE(sim->Step(views).ok());
    after(step, *sim);
  }
}

uint64_t Checksum(const Simulator& sim) {
  return StateChecksum({sim.x(), sim.m(), sim.v()});
}

TEST(OneBitOptionsTest, OffReproducesTheEarlierBits) {
  // Per-step checksums of x, m, v from compress/ before the options existed.
  const uint64_t onebit[kSteps] = {
      0x6a4bd42a7c079bcdull, 0x1388d9398ac21a66ull, 0xd1382dc026c7ee0full,
      0xe6d31dc04fc6f8e7ull, 0xd0c719a7c0d1793eull, 0xe3346a799dc6d2e0ull,
      0xca3328e380775ed7ull, 0xa268c23fbd32d9c3ull, 0x5b252725e3d2ba4eull,
      0xd1c2b232a5d385ffull, 0x33ceb0d48aaf6fc6ull, 0xe0386291455d1bebull};
  // And of Adam with int4 and EMA feedback (LoCo), which the options leave
  // alone.
  const uint64_t loco[kSteps] = {
      0xdd81e209d97edf80ull, 0xfbc96e5947c5eb19ull, 0xc29b581d0a735671ull,
      0x30f5f132b29962fdull, 0x51d479e17cb8e4f0ull, 0x72632fab745a3bbcull,
      0xc72fad67152a2818ull, 0x5d2c12a516421433ull, 0x5c9913661b4a57cfull,
      0x07c82e4b6d6d8d0aull, 0xed1f047a893b50ceull, 0x00200b41b73e57faull};
  AlgorithmConfig c = OneBitConfig();
  c.bias_correction = false;
  c.mask_zero_variance = false;
  c.bound_update = false;
  RunSteps(c, [&](int step, const Simulator& sim) {
    EXPECT_EQ(Checksum(sim), onebit[step]) << "step " << step;
  });
  AlgorithmConfig a = OneBitConfig();
  a.optimizer = OptimizerKind::kAdam;
  a.bias_correction = true;
  a.mask_zero_variance = false;
  a.up_codec = a.down_codec = CodecSpec{CodecKind::kInt4, 64};
  a.worker_feedback = a.server_feedback =
      FeedbackSpec{FeedbackKind::kEma, 0.5f};
  RunSteps(a, [&](int step, const Simulator& sim) {
    EXPECT_EQ(Checksum(sim), loco[step]) << "step " << step;
  });
}

TEST(OneBitOptionsTest, TheMaskKeepsZeroVarianceElementsStillAtTheDefaultEps) {
  AlgorithmConfig c = OneBitConfig();  // both options on, eps 1e-8
  ASSERT_TRUE(c.bias_correction && c.mask_zero_variance);
  std::vector<float> x_at_freeze;
  RunSteps(c, [&](int step, const Simulator& sim) {
    for (size_t j = 0; j < kDim; ++j) {
      ASSERT_TRUE(std::isfinite(sim.x()[j]))
          << "step " << step << " element " << j;
    }
    if (step + 1 == c.freeze_step)
      x_at_freeze.assign(sim.x().begin(), sim.x().end());
    if (step < c.freeze_step) return;
    for (size_t j = 0; j < kDim; j += 5) {
      ASSERT_EQ(sim.v()[j], 0.0f);
      uint32_t bits;
      std::memcpy(&bits, &sim.m()[j], 4);
      EXPECT_EQ(bits, 0u) << "m is +0, not -0, at element " << j << " step "
                          << step;
      EXPECT_EQ(sim.x()[j], x_at_freeze[j])
          << "no weight decay: x stays, element " << j;
    }
  });
  // Without the mask (and the bound) the same elements receive +-scale / eps.
  c.mask_zero_variance = false;
  c.bound_update = false;
  float largest_move = 0;
  RunSteps(c, [&](int step, const Simulator& sim) {
    if (step + 1 == c.freeze_step)
      x_at_freeze.assign(sim.x().begin(), sim.x().end());
    if (step < c.freeze_step) return;
    for (size_t j = 0; j < kDim; j += 5) {
      largest_move =
          std::max(largest_move, std::fabs(sim.x()[j] - x_at_freeze[j]));
    }
  });
  EXPECT_GT(largest_move, 1000.0f);
}

// Element j % 5 == 2 gets a gradient 1e-9 times the others': its frozen v is
// about 1e-18, not 0, so the mask leaves it and only the bound holds it.
std::vector<std::vector<float>> TinyGradients(uint32_t workers, int step) {
  auto g = Gradients(workers, step);
  for (auto& gi : g) {
    for (size_t j = 2; j < kDim; j += 5) gi[j] *= 1e-9f;
  }
  return g;
}

TEST(OneBitOptionsTest, TheBoundHoldsTinyVarianceElementsToAdamsLargestStep) {
  AlgorithmConfig c = OneBitConfig();  // every option on, eps 1e-8
  ASSERT_TRUE(c.bound_update);
  const float bound = OneBitUpdateBound(c.adam);
  // From the fp32 betas, in double: 3.16300 (0.9f and 0.999f are not 0.9,
  // 0.999).
  EXPECT_EQ(bound, static_cast<float>((1.0 - double{0.9f}) /
                                      std::sqrt(1.0 - double{0.999f})));
  std::vector<float> before;
  float largest_step = 0;
  RunSteps(
      c,
      [&](int step, const Simulator& sim) {
        if (step >= c.freeze_step) {
          for (size_t j = 0; j < kDim; ++j) {
            ASSERT_TRUE(std::isfinite(sim.x()[j]))
                << "step " << step << " element " << j;
            largest_step =
                std::max(largest_step, std::fabs(sim.x()[j] - before[j]));
          }
        }
        before.assign(sim.x().begin(), sim.x().end());
      },
      &TinyGradients);
  // lr * (bound + wd * |x|) with wd = 0, and one rounding of x.
  EXPECT_LE(largest_step, c.lr.base_lr * bound * 1.0001f);
  EXPECT_GT(largest_step, c.lr.base_lr * bound * 0.5f)
      << "the bound binds for the tiny elements";
  // Without it, the same elements take steps of about lr * scale / sqrt(v).
  c.bound_update = false;
  largest_step = 0;
  RunSteps(
      c,
      [&](int step, const Simulator& sim) {
        if (step >= c.freeze_step) {
          for (size_t j = 2; j < kDim; j += 5) {
            largest_step =
                std::max(largest_step, std::fabs(sim.x()[j] - before[j]));
          }
        }
        before.assign(sim.x().begin(), sim.x().end());
      },
      &TinyGradients);
  EXPECT_GT(largest_step, 1000.0f);
}

TEST(OneBitOptionsTest, TheBoundClampsOnlyRatiosBeyondIt) {
  AdamScalars s;
  s.lr = 0.5f;
  s.weight_decay = 0.25f;
  s.eps = 0.0f;
  const std::vector<float> c = {0.5f, -0.5f, 4.0f, -4.0f, 3.0f, NAN};
  const std::vector<float> v = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<float> x_free(c.size(), 2.0f), m_free(c.size());
  std::vector<float> x_bound = x_free, m_bound = m_free;
  FrozenVarianceStep(s, c, absl::MakeSpan(x_free), absl::MakeSpan(m_free), v);
  s.max_ratio = 3.0f;
  FrozenVarianceStep(s, c, absl::MakeSpan(x_bound), absl::MakeSpan(m_bound), v);
  // |ratio| <= 3: the same bits as without the bound.
  for (size_t j : {0, 1, 4}) EXPECT_EQ(x_bound[j], x_free[j]) << j;
  // Beyond it: x - lr * (+-3 + wd * x); m is still c, unclamped.
  EXPECT_EQ(x_bound[2], 2.0f - 0.5f * (3.0f + 0.25f * 2.0f));
  EXPECT_EQ(x_bound[3], 2.0f - 0.5f * (-3.0f + 0.25f * 2.0f));
  EXPECT_EQ(m_bound[2], 4.0f);
  // NaN is not hidden by the clamp.
  EXPECT_TRUE(std::isnan(x_bound[5]));
}

// The workers' betas and eps (StepHyper moments: a scheduler that cycles
// the momentum, groups with their own) govern onebit_adam's and
// onebit_lamb's step in both phases (design.md 2.1, 2.8): the local
// momentum's b1, the bias corrections, onebit_lamb's fresh variance
// correction, and from the freeze on v's frozen correction and the bound.
TEST(OneBitOptionsTest, TheWorkersBetasGovernEveryPhase) {
  AlgorithmConfig c = OneBitConfig();
  c.freeze_step = 10;
  const StepHyper hyper{0.02f, 0.0f, StepMoments{0.8f, 0.99f, 1e-6f}};
  AdamHyper own = c.adam;
  own.beta1 = 0.8f;
  own.beta2 = 0.99f;
  own.eps = 1e-6f;
  for (OptimizerKind kind :
       {OptimizerKind::kOneBitAdam, OptimizerKind::kOneBitLamb}) {
    c.optimizer = kind;
    ASSERT_TRUE(CheckStepHyper(c, hyper).ok());
    for (int64_t step : {3, 9, 10, 11}) {
      const bool frozen = step >= c.freeze_step;
      const SendRule send = PlanSend(c, step, Direction::kUp, 0, 0, &hyper);
      EXPECT_EQ(send.local_momentum, frozen);
      EXPECT_EQ(send.beta1, 0.8f);
      EXPECT_EQ(PlanSend(c, step, Direction::kUp, 0, 0).beta1, c.adam.beta1);
      const ReplyRule rule = PlanReply(c, step, &hyper);
      const AdamScalars want = MakeAdamScalars(own, 0.02f, step + 1, true);
      EXPECT_EQ(rule.scalars.beta1, 0.8f);
      EXPECT_EQ(rule.scalars.beta2, 0.99f);
      EXPECT_EQ(rule.scalars.eps, 1e-6f);
      EXPECT_EQ(rule.scalars.bias_correction1, want.bias_correction1) << step;
      EXPECT_EQ(
          rule.scalars.bias_correction2,
          frozen
              ? MakeAdamScalars(own, 0.0f, c.freeze_step, true).bias_correction2
              : want.bias_correction2)
          << step;
      EXPECT_EQ(rule.scalars.max_ratio,
                frozen ? OneBitUpdateBound(own)
                       : std::numeric_limits<float>::infinity());
      if (kind == OptimizerKind::kOneBitLamb) {
        EXPECT_TRUE(rule.lamb);
        EXPECT_EQ(rule.fresh_correction2, want.bias_correction2) << step;
      }
    }
  }
  // Each of them differs from the job's, so the checks above could fail.
  EXPECT_NE(OneBitUpdateBound(own), OneBitUpdateBound(c.adam));
  EXPECT_NE(
      MakeAdamScalars(own, 0.0f, c.freeze_step, true).bias_correction2,
      MakeAdamScalars(c.adam, 0.0f, c.freeze_step, true).bias_correction2);
  EXPECT_NE(MakeAdamScalars(own, 0.0f, 4, true).bias_correction2,
            MakeAdamScalars(c.adam, 0.0f, 4, true).bias_correction2);
  // diloco's inner steps take the job's: refused there (zero_one_adam:
  // ZeroOneTest.TheWorkersBetasGovernEveryPhase).
  c.optimizer = OptimizerKind::kDiloco;
  EXPECT_EQ(CheckStepHyper(c, hyper).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(OneBitOptionsTest, BiasCorrectionFreezesWithV) {
  AlgorithmConfig c = OneBitConfig();
  c.freeze_step = 10;
  const auto expected = [&](double beta, int64_t t) {
    return static_cast<float>(1.0 - std::pow(beta, t));
  };
  for (int64_t step : {0, 3, 9, 10, 11, 500}) {
    const ReplyRule rule = PlanReply(c, step);
    EXPECT_EQ(rule.frozen_variance, step >= 10);
    EXPECT_EQ(rule.mask, step >= 10);
    EXPECT_EQ(rule.scalars.max_ratio,
              step >= 10 ? OneBitUpdateBound(c.adam)
                         : std::numeric_limits<float>::infinity());
    EXPECT_EQ(rule.scalars.bias_correction1, expected(c.adam.beta1, step + 1))
        << step;
    EXPECT_EQ(rule.scalars.bias_correction2,
              expected(c.adam.beta2, step >= 10 ? 10 : step + 1))
        << step;
  }
  c.bias_correction = false;
  c.mask_zero_variance = false;
  c.bound_update = false;
  for (int64_t step : {0, 9, 10, 500}) {
    const ReplyRule rule = PlanReply(c, step);
    EXPECT_EQ(rule.scalars.max_ratio, std::numeric_limits<float>::infinity());
    EXPECT_EQ(rule.scalars.bias_correction1, 1.0f);
    EXPECT_EQ(rule.scalars.bias_correction2, 1.0f);
    EXPECT_FALSE(rule.mask);
  }
}

// A parameter group added mid-job (morse.torch's add_param_group at step
// k, StepHyper::first_step): its bias corrections count its own updates,
// t = step + 1 - k, and its frozen variance's freeze_step - k, as torch's
// per-parameter step does; only adam, onebit_adam and onebit_lamb take it,
// the latter two before freeze_step (1-bit LAMB's fresh variance's bc2'
// counts so too).
TEST(OneBitOptionsTest, AGroupAddedMidJobCountsItsOwnUpdates) {
  AlgorithmConfig c = OneBitConfig();
  c.freeze_step = 10;
  const auto expected = [&](double beta, int64_t t) {
    return static_cast<float>(1.0 - std::pow(beta, t));
  };
  const StepHyper added{0.01f, 0.0f, std::nullopt, /*first_step=*/6};
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kOneBitAdam,
                             OptimizerKind::kOneBitLamb}) {
    c.optimizer = kind;
    ASSERT_TRUE(CheckStepHyper(c, added).ok());
    const bool freezes = kind != OptimizerKind::kAdam;
    for (int64_t step : {6, 7, 9, 10, 11, 500}) {
      const ReplyRule rule = PlanReply(c, step, &added);
      EXPECT_EQ(rule.scalars.bias_correction1,
                expected(c.adam.beta1, step + 1 - 6))
          << step;
      EXPECT_EQ(
          rule.scalars.bias_correction2,
          expected(c.adam.beta2, freezes && step >= 10 ? 10 - 6 : step + 1 - 6))
          << step;
      if (kind == OptimizerKind::kOneBitLamb) {
        EXPECT_EQ(rule.fresh_correction2, expected(c.adam.beta2, step + 1 - 6))
            << step;
      }
    }
  }
  StepHyper late = added;
  late.first_step = 10;
  EXPECT_EQ(CheckStepHyper(c, late).code(), absl::StatusCode::kInvalidArgument);
  late.first_step = -1;
  EXPECT_EQ(ValidateStepHyper(late).code(), absl::StatusCode::kInvalidArgument);
  // diloco's inner steps count from the job's first step (zero_one_adam's
  // rule for it: ZeroOneTest.AGroupAddedMidJob*).
  c.optimizer = OptimizerKind::kDiloco;
  EXPECT_EQ(CheckStepHyper(c, added).code(),
            absl::StatusCode::kInvalidArgument);
  // Two hypers that differ in first_step alone are not the same step's.
  EXPECT_FALSE(SameStepHyper(added, StepHyper{0.01f, 0.0f}));
}

// The same through whole steps: a second segment that gets no gradient and
// no weight decay before step k (its m and v stay 0, its x unmoved) and
// trains from k with first_step k ends bit-identical to a job of that
// segment alone started at step 0 on the same gradients, across the
// freeze (at the same job step); the simulator refuses a first_step past the
// step. 1-bit LAMB's too, each segment a layer: the second's coefficient
// state stays where it starts (U = 0) until k.
TEST(OneBitOptionsTest, AGroupAddedMidJobTrainsAsAJobOfItsOwn) {
  constexpr uint64_t kFirst = 256, kSecond = 320;
  constexpr int64_t kAdded = 3;
  AlgorithmConfig both = OneBitConfig();
  both.freeze_step = 6;
  both.layout = {kFirst + kSecond, 2, 64, 128, {kFirst}};
  AlgorithmConfig alone = both;
  alone.layout = {kSecond, 2, 64, 128, {}};
  alone.freeze_step = both.freeze_step - kAdded;  // the same job step
  const auto grad = [](uint32_t i, int64_t step, size_t j) {
    return std::sin(0.1f * j + 0.7f * i + 0.3f * step);
  };
  std::vector<float> x0(kFirst + kSecond);
  for (size_t j = 0; j < x0.size(); ++j) x0[j] = 0.01f * (j % 13) - 0.05f;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kOneBitAdam,
                             OptimizerKind::kOneBitLamb}) {
    both.optimizer = alone.optimizer = kind;
    if (kind == OptimizerKind::kOneBitLamb) {
      both.layers = {kFirst, kSecond};
      alone.layers = {kSecond};
    }
    auto sim = Simulator::Create(both, x0);
    ASSERT_TRUE(sim.ok()) << sim.status();
    auto own = Simulator::Create(
        alone, absl::MakeConstSpan(x0).subspan(kFirst, kSecond));
    ASSERT_TRUE(own.ok()) << own.status();
    for (int64_t step = 0; step < 14; ++step) {
      std::vector<std::vector<float>> g(both.workers,
                                        std::vector<float>(kFirst + kSecond));
      std::vector<std::vector<float>> g_own(both.workers,
                                            std::vector<float>(kSecond));
      for (uint32_t i = 0; i < both.workers; ++i) {
        for (size_t j = 0; j < kFirst; ++j) g[i][j] = grad(i, step, j);
        for (size_t j = 0; step >= kAdded && j < kSecond; ++j)
          g[i][kFirst + j] = g_own[i][j] = grad(i + 5, step - kAdded, j);
      }
      std::vector<absl::Span<const float>> views(g.begin(), g.end());
      std::vector<StepHyper> hypers{StepHyper{0.01f, 0.0f},
                                    StepHyper{0.02f, 0.0f}};
      if (step >= kAdded) hypers[1].first_step = kAdded;
      if (step == kAdded - 1) {  // the group is not there yet
        StepHyper early = hypers[1];
        early.first_step = kAdded;
        EXPECT_EQ(sim->Step(views, {hypers[0], early}).code(),
                  absl::StatusCode::kInvalidArgument);
      }
      ASSERT_TRUE(sim->Step(views, hypers).ok()) << step;
      if (step < kAdded) {
        for (size_t j = 0; j < kSecond; ++j)
          ASSERT_EQ(sim->x()[kFirst + j], x0[kFirst + j]) << step;
        continue;
      }
      std::vector<absl::Span<const float>> own_views(g_own.begin(),
                                                     g_own.end());
      ASSERT_TRUE(own->Step(own_views, {StepHyper{0.02f, 0.0f}}).ok());
      for (size_t j = 0; j < kSecond; ++j) {
        ASSERT_EQ(sim->x()[kFirst + j], own->x()[j])
            << "step " << step << " element " << j;
        ASSERT_EQ(sim->v()[kFirst + j], own->v()[j]) << step;
      }
    }
  }
}

TEST(OneBitOptionsTest, FreezeStepZeroIsRefused) {
  AlgorithmConfig c = OneBitConfig();
  c.freeze_step = 0;
  const auto sim = Simulator::Create(c, X0());
  EXPECT_EQ(sim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sim.status().message().find("freeze_step"),
            absl::string_view::npos);
}

// EncodeWorkerMessage forms a sign1 compression-phase message a chunk of
// blocks at a time (the momentum never goes to memory): the payload and the
// error buffer must be the bits of forming the momentum whole first, for a
// range of several chunks with a short last block, with the zero-variance
// mask holding some elements and with a clip factor.
TEST(OneBitOptionsTest, AChunkedCompressionPhaseMessageHasTheBitsOfAWholeOne) {
  const uint64_t dim =
      3 * 32768 + 1000;  // three full chunks and a part, last block short
  AlgorithmConfig c = OneBitConfig();
  c.layout = {dim, 1, 64, dim / 64 * 64 + 64};
  c.workers = 1;
  Replica replica(c, {0, dim});
  std::vector<float> g(dim);
  for (uint64_t j = 0; j < dim; ++j) {
    g[j] = std::sin(0.37f * static_cast<float>(j)) *
           (1.0f + static_cast<float>(j % 11));
    replica.mutable_m()[j] = 0.25f * std::cos(0.11f * static_cast<float>(j));
    replica.mutable_v()[j] =
        j % 97 == 0 ? 0.0f : 1e-3f;  // some masked elements
  }
  for (float scale : {1.0f, 0.37f}) {
    ErrorFeedback whole_error(c.worker_feedback, dim, 64),
        chunked_error(c.worker_feedback, dim, 64);
    const SendRule rule = PlanSend(c, c.freeze_step + 1, Direction::kUp, 0, 0);
    ASSERT_TRUE(rule.local_momentum && rule.mask && rule.feedback);
    std::vector<uint8_t> whole(PayloadBytes(rule.codec, dim)),
        chunked(whole.size(), 0xAB);
    for (int round = 0; round < 2;
         ++round) {  // the second round reads the errors of the first
      std::vector<float> local(dim);
      replica.LocalMomentum(rule.beta1, 0, g, absl::MakeSpan(local), scale);
      ASSERT_TRUE(whole_error
                      .Compress(rule.codec, 0, local, rule.key,
                                absl::MakeSpan(whole), replica.v())
                      .ok());
      ASSERT_TRUE(EncodeWorkerMessage(rule, replica, chunked_error, 0, g, scale,
                                      absl::MakeSpan(chunked))
                      .ok());
      ASSERT_EQ(whole, chunked) << "scale " << scale << " round " << round;
      std::vector<float> a(dim), b(dim);
      whole_error.Read(0, absl::MakeSpan(a));
      chunked_error.Read(0, absl::MakeSpan(b));
      ASSERT_EQ(std::memcmp(a.data(), b.data(), 4 * dim), 0)
          << "scale " << scale;
    }
  }
}

// The encodes read v for the mask only where some element is 0
// (Replica::VarianceMask): v's span where a block of it holds a 0, none
// where no block does, and what it knew forgotten wherever v is written
// (a restore through mutable_v, a warmup step's ApplyReply).
TEST(OneBitOptionsTest, TheMaskReadsVOnlyWhereSomeElementIsZero) {
  const uint64_t dim = 4 * 64 + 10;  // blocks of 64, the last short
  AlgorithmConfig c = OneBitConfig();
  c.layout = {dim, 1, 64, 320};
  c.adam.beta2 = 0.25f;  // a step with no gradient takes v's least to 0
  Replica replica(c, {0, dim});
  for (uint64_t j = 0; j < dim; ++j) replica.mutable_v()[j] = 1e-3f;
  EXPECT_TRUE(replica.VarianceMask(0, dim).empty());
  EXPECT_TRUE(replica.VarianceMask(100, 50).empty());

  replica.mutable_v()[130] = 0.0f;  // block 2
  const absl::Span<const float> whole = replica.VarianceMask(0, dim);
  EXPECT_EQ(whole.data(), replica.v().data());
  EXPECT_EQ(whole.size(), dim);
  const absl::Span<const float> part = replica.VarianceMask(120, 20);
  EXPECT_EQ(part.data(), replica.v().data() + 120);
  EXPECT_EQ(part.size(), 20u);
  EXPECT_TRUE(replica.VarianceMask(0, 128).empty());   // blocks 0 and 1
  EXPECT_TRUE(replica.VarianceMask(192, 74).empty());  // block 3 and the last

  // A warmup step writes v: with no gradient and beta2 0.25 the least
  // positive float becomes 0, and the mask must see it.
  for (uint64_t j = 0; j < dim; ++j)
    replica.mutable_v()[j] = std::numeric_limits<float>::denorm_min();
  ASSERT_TRUE(replica.VarianceMask(0, dim).empty());
  const ReplyRule rule = PlanReply(c, 0);
  ASSERT_FALSE(rule.frozen_variance);
  std::vector<uint8_t> reply(PayloadBytes(rule.codec, dim));
  ASSERT_TRUE(Encode(rule.codec, std::vector<float>(dim, 0.0f), {},
                     absl::MakeSpan(reply))
                  .ok());
  ASSERT_TRUE(replica.ApplyReply(0, 0, dim, reply).ok());
  ASSERT_EQ(replica.v()[0], 0.0f);
  EXPECT_EQ(replica.VarianceMask(0, dim).data(), replica.v().data());
  EXPECT_FALSE(replica.VarianceMask(64, 64).empty());
}

// Replica::ApplyReply decodes a sign1 reply a chunk of blocks at a time and
// updates while the chunk is in cache: the bits of decoding the whole
// partition first, with the mask and the bounded update (compression phase)
// over several chunks and a short last block.
TEST(OneBitOptionsTest, AChunkedReplyUpdateHasTheBitsOfAWholeOne) {
  const uint64_t dim = 3 * 32768 + 1000;
  AlgorithmConfig c = OneBitConfig();
  c.layout = {dim, 1, 64, dim / 64 * 64 + 64};
  Replica chunked(c, {0, dim});
  std::vector<float> x(dim), m(dim), v(dim), u(dim);
  for (uint64_t j = 0; j < dim; ++j) {
    x[j] = chunked.x()[j] = std::cos(0.3f * static_cast<float>(j));
    m[j] = chunked.mutable_m()[j] =
        0.1f * std::sin(0.7f * static_cast<float>(j));
    v[j] = chunked.mutable_v()[j] =
        j % 89 == 0 ? 0.0f : 1e-4f * static_cast<float>(1 + j % 5);
    u[j] = std::sin(0.13f * static_cast<float>(j)) - 0.2f;
  }
  const int64_t step = c.freeze_step + 2;
  const ReplyRule rule = PlanReply(c, step);
  ASSERT_TRUE(rule.frozen_variance && rule.mask &&
              rule.codec.kind == CodecKind::kSign1);
  std::vector<uint8_t> reply(PayloadBytes(rule.codec, dim));
  ASSERT_TRUE(Encode(rule.codec, u, {}, absl::MakeSpan(reply)).ok());
  ASSERT_TRUE(chunked.ApplyReply(step, 0, dim, reply).ok());
  std::vector<float> decoded(dim);
  ASSERT_TRUE(Decode(rule.codec, reply, absl::MakeSpan(decoded)).ok());
  ApplyRule(rule, absl::MakeSpan(decoded), absl::MakeSpan(x), absl::MakeSpan(m),
            absl::MakeSpan(v));
  EXPECT_EQ(std::memcmp(chunked.x().data(), x.data(), 4 * dim), 0);
  EXPECT_EQ(std::memcmp(chunked.m().data(), m.data(), 4 * dim), 0);
  EXPECT_EQ(std::memcmp(chunked.v().data(), v.data(), 4 * dim), 0);
  // A truncated reply is refused with nothing changed.
  const uint64_t before = chunked.Checksum();
  EXPECT_EQ(chunked
                .ApplyReply(step, 0, dim,
                            absl::MakeSpan(reply).first(reply.size() - 1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(chunked.Checksum(), before);
}

// EncodeShardReply averages sign1 pushes and recompresses them with the
// shard's error a chunk of blocks at a time: the bits of averaging the whole
// partition first, with the mask, over several chunks and a short last
// block at the end of the shard's buffer; and a push whose huge scales make
// a late chunk's recompression fail leaves the whole error as it was.
TEST(OneBitOptionsTest, AChunkedShardReplyHasTheBitsOfAWholeOne) {
  const uint64_t dim = 3 * 32768 + 1000;
  const uint64_t offset =
      640;  // the partition starts inside the shard's buffer
  AlgorithmConfig c = OneBitConfig();
  c.layout = {dim, 1, 64, dim / 64 * 64 + 64};
  const int64_t step = c.freeze_step + 1;
  const SendRule up = PlanSend(c, step, Direction::kUp, 0, 0);
  const SendRule down = PlanSend(c, step, Direction::kDown, c.workers, 0);
  ASSERT_TRUE(down.feedback && down.mask &&
              down.codec.kind == CodecKind::kSign1);
  std::vector<std::vector<uint8_t>> pushes(
      c.workers, std::vector<uint8_t>(PayloadBytes(up.codec, dim)));
  std::vector<float> v(dim);
  for (uint32_t i = 0; i < c.workers; ++i) {
    std::vector<float> g(dim);
    for (uint64_t j = 0; j < dim; ++j)
      g[j] = std::sin(0.31f * static_cast<float>(j) + 0.9f * i) + 0.1f * i;
    ASSERT_TRUE(Encode(up.codec, g, {}, absl::MakeSpan(pushes[i])).ok());
  }
  for (uint64_t j = 0; j < dim; ++j) v[j] = j % 83 == 0 ? 0.0f : 1e-3f;
  std::vector<absl::Span<const uint8_t>> views(pushes.begin(), pushes.end());
  ErrorFeedback whole_error(c.server_feedback, offset + dim, 64),
      chunked_error(c.server_feedback, offset + dim, 64);
  std::vector<uint8_t> whole(PayloadBytes(down.codec, dim)),
      chunked(whole.size(), 0xCD);
  for (int round = 0; round < 2;
       ++round) {  // the second round reads the errors of the first
    std::vector<float> average(dim);
    ASSERT_TRUE(DecodeAverage(up.codec, views, absl::MakeSpan(average)).ok());
    ASSERT_TRUE(whole_error
                    .Compress(down.codec, offset, average, down.key,
                              absl::MakeSpan(whole), v)
                    .ok());
    ASSERT_TRUE(EncodeShardReply(down, up.codec, views, chunked_error, offset,
                                 dim, v, absl::MakeSpan(chunked))
                    .ok());
    ASSERT_EQ(whole, chunked) << "round " << round;
    std::vector<float> a(offset + dim), b(offset + dim);
    whole_error.Read(0, absl::MakeSpan(a));
    chunked_error.Read(0, absl::MakeSpan(b));
    ASSERT_EQ(std::memcmp(a.data(), b.data(), 4 * a.size()), 0)
        << "round " << round;
  }
  // Huge but finite scales in the third chunk of every push: their sum
  // overflows, so that chunk's recompression fails after two chunks were
  // recompressed; the error buffer must be exactly as before.
  const uint64_t blocks = (dim + 63) / 64;
  for (auto& push : pushes) {
    const float huge = 3e38f;
    std::memcpy(push.data() + 4 * (2 * 32768 / 64 + 3), &huge, 4);
  }
  std::vector<float> before(offset + dim), after(offset + dim);
  chunked_error.Read(0, absl::MakeSpan(before));
  EXPECT_EQ(EncodeShardReply(down, up.codec, views, chunked_error, offset, dim,
                             v, absl::MakeSpan(chunked))
                .code(),
            absl::StatusCode::kInvalidArgument);
  chunked_error.Read(0, absl::MakeSpan(after));
  EXPECT_EQ(std::memcmp(before.data(), after.data(), 4 * before.size()), 0);
  EXPECT_GT(blocks, 2 * 32768 / 64 + 3);
}

// The warmup's fp32 (or fp16, bf16) exchange a piece at a time: the shard's
// average encoded while in cache (EncodeShardReply) and a reply applied
// while in cache (Replica::ApplyReply) have the bits of the whole-partition
// average, encode, decode and update, over several pieces and a short last
// one starting inside the shard's buffer; a push of the wrong length is
// refused with nothing written.
TEST(OneBitOptionsTest, AWarmupExchangeInPiecesHasTheBitsOfAWholeOne) {
  const uint64_t dim = 3 * 16384 + 1000, offset = 640;
  for (CodecKind kind : {CodecKind::kFp32, CodecKind::kBf16}) {
    AlgorithmConfig c = OneBitConfig();
    c.layout = {dim, 1, 64, dim / 64 * 64 + 64};
    c.warmup_codec = CodecSpec{kind};
    const int64_t step = 1;
    const SendRule up = PlanSend(c, step, Direction::kUp, 0, 0);
    const SendRule down = PlanSend(c, step, Direction::kDown, c.workers, 0);
    ASSERT_TRUE(!down.feedback && down.codec.kind == kind);
    std::vector<std::vector<uint8_t>> pushes(
        c.workers, std::vector<uint8_t>(PayloadBytes(up.codec, dim)));
    for (uint32_t i = 0; i < c.workers; ++i) {
      std::vector<float> g(dim);
      for (uint64_t j = 0; j < dim; ++j)
        g[j] = j % 97 == 0 ? -0.0f
                           : std::sin(0.31f * static_cast<float>(j) + 0.9f * i);
      ASSERT_TRUE(Encode(up.codec, g, {}, absl::MakeSpan(pushes[i])).ok());
    }
    std::vector<absl::Span<const uint8_t>> views(pushes.begin(), pushes.end());
    std::vector<float> average(dim);
    ASSERT_TRUE(DecodeAverage(up.codec, views, absl::MakeSpan(average)).ok());
    std::vector<uint8_t> whole(PayloadBytes(down.codec, dim)),
        pieces(whole.size(), 0xCD);
    ASSERT_TRUE(Encode(down.codec, average, {}, absl::MakeSpan(whole)).ok());
    ErrorFeedback error(c.server_feedback, offset + dim, 64);
    ASSERT_TRUE(EncodeShardReply(down, up.codec, views, error, offset, dim, {},
                                 absl::MakeSpan(pieces))
                    .ok());
    ASSERT_EQ(whole, pieces) << CodecName(kind);
    std::vector<uint8_t> short_push(pushes[1].begin(), pushes[1].end() - 1);
    views[1] = short_push;
    std::vector<uint8_t> untouched(pieces.size(), 0xCD);
    EXPECT_EQ(EncodeShardReply(down, up.codec, views, error, offset, dim, {},
                               absl::MakeSpan(untouched))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(untouched, std::vector<uint8_t>(pieces.size(), 0xCD));
    // The reply applied in pieces against the whole decode and update.
    Replica replica(c, {0, dim});
    std::vector<float> x(dim), m(dim), v(dim);
    for (uint64_t j = 0; j < dim; ++j) {
      x[j] = replica.x()[j] = std::cos(0.3f * static_cast<float>(j));
      m[j] = replica.mutable_m()[j] =
          0.1f * std::sin(0.7f * static_cast<float>(j));
      v[j] = replica.mutable_v()[j] = 1e-4f * static_cast<float>(1 + j % 5);
    }
    const ReplyRule rule = PlanReply(c, step);
    ASSERT_TRUE(replica.ApplyReply(step, 0, dim, whole).ok());
    std::vector<float> decoded(dim);
    ASSERT_TRUE(Decode(rule.codec, whole, absl::MakeSpan(decoded)).ok());
    ApplyRule(rule, absl::MakeSpan(decoded), absl::MakeSpan(x),
              absl::MakeSpan(m), absl::MakeSpan(v));
    EXPECT_EQ(std::memcmp(replica.x().data(), x.data(), 4 * dim), 0);
    EXPECT_EQ(std::memcmp(replica.m().data(), m.data(), 4 * dim), 0);
    EXPECT_EQ(std::memcmp(replica.v().data(), v.data(), 4 * dim), 0);
    const uint64_t before = replica.Checksum();
    EXPECT_EQ(replica
                  .ApplyReply(step, 0, dim,
                              absl::MakeSpan(whole).first(whole.size() - 1))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(replica.Checksum(), before);
  }
}

}  // namespace
}  // namespace morse::compress
