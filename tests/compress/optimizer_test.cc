// The optimizer seam (compress/optimizer.h): every optimizer found by its
// JobConfig name, its state arrays checked by name and size, and the
// algorithm fingerprints that checkpoints carry unchanged by the seam.
#include "compress/optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "compress/layout.h"
#include "compress/optimizers/diloco.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "compress/step_plan.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

AlgorithmConfig Config(OptimizerKind kind) {
  AlgorithmConfig c;
  c.optimizer = kind;
  c.workers = 2;
  c.layout.dim = 1000;
  c.layout.shards = 2;
  c.layout.block_elems = 16;
  c.layout.partition_elems = 256;
  c.freeze_step = 3;
  c.layers = {600, 400};
  c.clip_grad_norm =
      kind == OptimizerKind::kOneBitLamb || kind == OptimizerKind::kDiloco
          ? 0.0f
          : 1.5f;
  c.seed = 7;
  return c;
}

TEST(OptimizerTest, EveryOptimizerIsFoundByItsName) {
  for (OptimizerKind kind :
       {OptimizerKind::kOneBitAdam, OptimizerKind::kAdam,
        OptimizerKind::kZeroOneAdam, OptimizerKind::kOneBitLamb,
        OptimizerKind::kDiloco}) {
    const Optimizer& optimizer = OptimizerOf(kind);
    EXPECT_EQ(optimizer.kind(), kind);
    const Optimizer* found = FindOptimizer(optimizer.name());
    ASSERT_NE(found, nullptr) << optimizer.name();
    EXPECT_EQ(found, &optimizer);
    EXPECT_TRUE(optimizer.Validate(Config(kind)).ok()) << optimizer.name();
  }
  EXPECT_EQ(FindOptimizer("lamb"), nullptr);
  EXPECT_EQ(OptimizerNames(),
            "onebit_adam, adam, zero_one_adam, onebit_lamb or diloco");
}

// Checkpoints (shards' and workers') carry AlgorithmFingerprint and are
// refused under another: these are the values the code before the seam
// computed for the same configs, so that files written then still load.
TEST(OptimizerTest, FingerprintsAreThoseOfEarlierCheckpoints) {
  EXPECT_EQ(AlgorithmFingerprint(Config(OptimizerKind::kOneBitAdam)),
            0xbf21036832ce01e6u);
  EXPECT_EQ(AlgorithmFingerprint(Config(OptimizerKind::kAdam)),
            0x2c918666f724f283u);
  EXPECT_EQ(AlgorithmFingerprint(Config(OptimizerKind::kZeroOneAdam)),
            0x3b3dbc8555fd3390u);
  EXPECT_EQ(AlgorithmFingerprint(Config(OptimizerKind::kOneBitLamb)),
            0x2db4dcdf367c8af4u);
}

TEST(OptimizerTest, StateIsCheckedByNameSizeAndValue) {
  const AlgorithmConfig lamb = Config(OptimizerKind::kOneBitLamb);
  const std::vector<StateArray> arrays = OptimizerOf(lamb).State(lamb);
  ASSERT_EQ(arrays.size(), 2u);
  EXPECT_EQ(arrays[0].name, "v_fresh");
  EXPECT_TRUE(arrays[0].per_element);
  EXPECT_EQ(arrays[1].name, "lamb_layers");
  EXPECT_EQ(arrays[1].floats, 4u);  // 2 layers: coeff_freeze, last_factor
  EXPECT_EQ(StateBytesPerElement(lamb), 4u);
  EXPECT_TRUE(CommitsLayers(lamb));

  std::vector<NamedState> state = {{"v_fresh", std::vector<float>(256, 0.5f)},
                                   {"lamb_layers", {0.0f, 1.0f, 0.0f, 1.0f}}};
  EXPECT_TRUE(CheckState(lamb, 256, state, "partition 0").ok());
  // Sized for another range.
  absl::Status s = CheckState(lamb, 200, state, "partition 0");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("256 values of v_fresh; onebit_lamb needs 200"),
            std::string::npos)
      << s;
  // Missing or misnamed arrays.
  std::vector<NamedState> missing = {state[1]};
  s = CheckState(lamb, 256, missing, "partition 0");
  EXPECT_NE(s.message().find("[lamb_layers]; onebit_lamb keeps [v_fresh, "
                             "lamb_layers]"),
            std::string::npos)
      << s;
  std::vector<NamedState> renamed = state;
  renamed[0].name = "v";
  EXPECT_EQ(CheckState(lamb, 256, renamed, "partition 0").code(),
            absl::StatusCode::kInvalidArgument);
  // Values no replica holds (the optimizer's ValidateState).
  std::vector<NamedState> negative = state;
  negative[0].values[3] = -1.0f;
  s = CheckState(lamb, 256, negative, "partition 0");
  EXPECT_NE(s.message().find("partition 0: v' holds a negative"),
            std::string::npos)
      << s;

  // The others keep no state of their own and commit nothing.
  for (OptimizerKind kind : {OptimizerKind::kOneBitAdam, OptimizerKind::kAdam,
                             OptimizerKind::kZeroOneAdam}) {
    const AlgorithmConfig c = Config(kind);
    EXPECT_TRUE(OptimizerOf(c).State(c).empty());
    EXPECT_FALSE(CommitsLayers(c));
    EXPECT_TRUE(CheckState(c, 256, {}, "partition 0").ok());
    EXPECT_EQ(CheckState(c, 256, state, "partition 0").code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(StepsLocally(Config(OptimizerKind::kZeroOneAdam)));
}

TEST(OptimizerTest, PhasesFollowEachOptimizersSchedule) {
  const AlgorithmConfig onebit = Config(OptimizerKind::kOneBitAdam);
  EXPECT_STREQ(PhaseName(onebit, 2), "warmup");
  EXPECT_STREQ(PhaseName(onebit, 3), "compression");
  EXPECT_FALSE(PlanStep(onebit, 2).feedback);
  EXPECT_TRUE(PlanStep(onebit, 3).compressing);
  const AlgorithmConfig adam = Config(OptimizerKind::kAdam);
  EXPECT_STREQ(PhaseName(adam, 5), "adam");
  EXPECT_FALSE(PlanStep(adam, 5).compressing);
  EXPECT_TRUE(PlanStep(adam, 5).feedback);
  AlgorithmConfig zero_one = Config(OptimizerKind::kZeroOneAdam);
  zero_one.zero_one.var_freeze_step = 4;
  zero_one.zero_one.var_update_scaler = 2;
  zero_one.zero_one.local_step_scaler = 1;
  zero_one.zero_one.local_step_clipper = 4;
  EXPECT_STREQ(PhaseName(zero_one, 0), "variance");     // s = 1
  EXPECT_STREQ(PhaseName(zero_one, 2), "compression");  // s = 3: not in T_v
  EXPECT_STREQ(PhaseName(zero_one, 4), "sync");   // s = F + 1 always syncs
  EXPECT_STREQ(PhaseName(zero_one, 5), "sync");   // s = 6: interval 2
  EXPECT_STREQ(PhaseName(zero_one, 6), "local");  // s = 7: interval 4
  EXPECT_FALSE(PlanStep(zero_one, 6).exchanges);
  EXPECT_EQ(NextExchange(zero_one, 5), 5);
  EXPECT_EQ(NextExchange(zero_one, 6), 7);  // s = 8 syncs
}

TEST(OptimizerTest, DilocoRefusesWhatItCannotRun) {
  const Optimizer& diloco = OptimizerOf(OptimizerKind::kDiloco);
  EXPECT_FALSE(diloco.HasGpuKernels());
  EXPECT_EQ(diloco.InnerSteps(Config(OptimizerKind::kDiloco)), 500);
  EXPECT_EQ(OptimizerOf(OptimizerKind::kAdam)
                .InnerSteps(Config(OptimizerKind::kAdam)),
            0);
  EXPECT_FALSE(diloco.FreezesVariance());
  const auto refused = [&](void (*edit)(AlgorithmConfig&), const char* what) {
    AlgorithmConfig c = Config(OptimizerKind::kDiloco);
    edit(c);
    const absl::Status s = diloco.Validate(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), absl::string_view::npos) << s;
  };
  refused([](AlgorithmConfig& c) { c.diloco.sync_every = 0; }, "sync_every");
  refused([](AlgorithmConfig& c) { c.diloco.outer_lr = 0; }, "outer_lr");
  refused([](AlgorithmConfig& c) { c.diloco.outer_lr = NAN; }, "outer_lr");
  refused([](AlgorithmConfig& c) { c.diloco.outer_momentum = 1; },
          "outer_momentum");
  refused([](AlgorithmConfig& c) { c.diloco.outer_momentum = -0.5f; },
          "outer_momentum");
  refused([](AlgorithmConfig& c) { c.clip_grad_norm = 1; }, "clip_grad_norm");
  refused([](AlgorithmConfig& c) { c.diloco.warmup_steps = -1; },
          "warmup_steps");
  refused([](AlgorithmConfig& c) { c.diloco.warmup_sync_every = 0; },
          "warmup_sync_every");
  refused(
      [](AlgorithmConfig& c) {  // the warmup's syncs one inner step apart
        c.diloco.sync_every = 4;
        c.diloco.overlap_steps = 1;
        c.diloco.warmup_steps = 3;
      },
      "below warmup_sync_every");
  // Each outer setting is part of the job's fingerprint.
  const AlgorithmConfig base = Config(OptimizerKind::kDiloco);
  for (void (*edit)(AlgorithmConfig&) :
       {+[](AlgorithmConfig& c) { c.diloco.sync_every = 7; },
        +[](AlgorithmConfig& c) { c.diloco.outer_lr = 0.5f; },
        +[](AlgorithmConfig& c) { c.diloco.outer_momentum = 0.5f; },
        +[](AlgorithmConfig& c) { c.diloco.nesterov = false; },
        +[](AlgorithmConfig& c) { c.diloco.warmup_steps = 10; },
        +[](AlgorithmConfig& c) {
          c.diloco.warmup_steps = 10;
          c.diloco.warmup_sync_every = 2;
        }}) {
    AlgorithmConfig c = base;
    edit(c);
    EXPECT_NE(AlgorithmFingerprint(c), AlgorithmFingerprint(base));
  }
}

// Every step of diloco is an outer step: the reply (the averaged
// pseudo-gradient d) moves x and the outer momentum m by SGD with Nesterov
// momentum, m = mu*m + d, x -= lr * (d + mu*m), or plain momentum, x -= lr *
// m; v is untouched.
TEST(OptimizerTest, DilocoTakesAnOuterStepOnTheReply) {
  for (const bool nesterov : {true, false}) {
    AlgorithmConfig c = Config(OptimizerKind::kDiloco);
    c.up_codec = c.down_codec = CodecSpec{CodecKind::kFp32};
    c.diloco = {/*sync_every=*/4, /*outer_lr=*/0.7f, /*outer_momentum=*/0.9f,
                nesterov};
    EXPECT_STREQ(PhaseName(c, 3), "outer");
    EXPECT_TRUE(PlanStep(c, 3).exchanges);
    EXPECT_FALSE(PlanStep(c, 3).compressing);
    const uint64_t n = 64;
    Replica replica(c, Range{0, n});
    std::vector<float> x(n);
    for (uint64_t j = 0; j < n; ++j) x[j] = 0.25f * static_cast<float>(j);
    std::copy(x.begin(), x.end(), replica.x().begin());
    std::vector<float> m(n, 0.0f);
    for (int64_t step = 0; step < 3; ++step) {
      std::vector<float> d(n);
      for (uint64_t j = 0; j < n; ++j)
        d[j] = 0.01f * static_cast<float>((j * 7 + step * 3) % 11) - 0.05f;
      std::vector<uint8_t> reply(4 * n);
      ASSERT_TRUE(
          Encode(c.down_codec, d, RoundingKey{}, absl::MakeSpan(reply)).ok());
      ASSERT_TRUE(replica.ApplyReply(step, 0, n, reply).ok());
      for (uint64_t j = 0; j < n; ++j) {
        m[j] = 0.9f * m[j] + d[j];
        x[j] = x[j] - 0.7f * (nesterov ? d[j] + 0.9f * m[j] : m[j]);
      }
      for (uint64_t j = 0; j < n; ++j) {
        ASSERT_EQ(replica.x()[j], x[j]) << "step " << step << " element " << j;
        ASSERT_EQ(replica.m()[j], m[j]) << "step " << step << " element " << j;
        ASSERT_EQ(replica.v()[j], 0.0f);
      }
    }
  }
}

// Streaming DiLoCo: with F fragments, step t syncs the partitions q with
// q mod F == t mod F; the others' pushes and replies are empty and nothing
// of them moves. The simulator (what every replica reproduces) against the
// algorithm written out, over two rounds of both fragments.
// A diloco config that validates: every codec in the layout's blocks.
AlgorithmConfig StreamingConfig() {
  AlgorithmConfig c = Config(OptimizerKind::kDiloco);
  c.up_codec = c.down_codec = c.warmup_codec = CodecSpec{CodecKind::kFp32, 16};
  c.layers.clear();
  return c;
}

// The inner steps before each outer step: the warmup's count for the first
// warmup_steps outer steps, then sync_every / fragments each (the schedule
// written out).
TEST(OptimizerTest, DilocoWarmupSyncsSoonerThenEveryInterval) {
  AlgorithmConfig c = StreamingConfig();
  c.diloco.sync_every = 6;
  EXPECT_EQ(InnerStepsBefore(c, 0), 0);
  EXPECT_EQ(InnerStepsBefore(c, 3), 18);  // no warmup: every 6
  c.diloco.warmup_steps = 3;
  ASSERT_TRUE(ValidateAlgorithmConfig(c).ok()) << ValidateAlgorithmConfig(c);
  const std::vector<int64_t> want = {0, 1, 2, 3, 9, 15};
  for (int64_t t = 0; t < static_cast<int64_t>(want.size()); ++t)
    EXPECT_EQ(InnerStepsBefore(c, t), want[t]) << "outer step " << t;
  c.diloco.warmup_sync_every = 2;
  c.diloco.fragments = 2;  // after the warmup, one fragment every 3
  c.diloco.overlap_steps = 1;
  ASSERT_TRUE(ValidateAlgorithmConfig(c).ok()) << ValidateAlgorithmConfig(c);
  const std::vector<int64_t> streaming = {0, 2, 4, 6, 9, 12};
  for (int64_t t = 0; t < static_cast<int64_t>(streaming.size()); ++t)
    EXPECT_EQ(InnerStepsBefore(c, t), streaming[t]) << "outer step " << t;
  EXPECT_EQ(OptimizerOf(c).InnerSteps(c), 3);  // the steady interval
}

TEST(OptimizerTest, StreamingDilocoSyncsOneFragmentAStep) {
  AlgorithmConfig c = StreamingConfig();
  c.diloco = {/*sync_every=*/4, /*outer_lr=*/0.7f, /*outer_momentum=*/0.9f,
              /*nesterov=*/true, /*fragments=*/2};
  ASSERT_TRUE(ValidateAlgorithmConfig(c).ok()) << ValidateAlgorithmConfig(c);
  EXPECT_EQ(OptimizerOf(c).InnerSteps(c), 2);
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->partitions().size(), 4u);
  for (const Partition& p : layout->partitions()) {
    for (int64_t step = 0; step < 4; ++step) {
      EXPECT_EQ(Idle(c, step, p.range.begin), p.id % 2 != step % 2);
      const SendRule up = PlanSend(c, step, Direction::kUp, 0, p.range.begin);
      EXPECT_EQ(SendBytes(up, p.range.size()),
                p.id % 2 == step % 2 ? 4 * p.range.size() : 0u);
    }
  }
  const uint64_t n = c.layout.dim;
  std::vector<float> x0(n);
  for (uint64_t j = 0; j < n; ++j) x0[j] = 0.001f * static_cast<float>(j);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok()) << sim.status();
  std::vector<float> x = x0, m(n, 0.0f);
  for (int64_t step = 0; step < 4; ++step) {
    // Both workers push the same d, so the average is d exactly.
    std::vector<float> d(n);
    for (uint64_t j = 0; j < n; ++j)
      d[j] = 0.01f * static_cast<float>((j * 7 + step * 3) % 11) - 0.05f;
    const std::vector<absl::Span<const float>> pushed = {d, d};
    ASSERT_TRUE(sim->Step(pushed).ok());
    for (const Partition& p : layout->partitions()) {
      if (p.id % 2 != step % 2) continue;
      for (uint64_t j = p.range.begin; j < p.range.end; ++j) {
        m[j] = 0.9f * m[j] + d[j];
        x[j] = x[j] - 0.7f * (d[j] + 0.9f * m[j]);
      }
    }
    for (uint64_t j = 0; j < n; ++j) {
      ASSERT_EQ(sim->x()[j], x[j]) << "step " << step << " element " << j;
      ASSERT_EQ(sim->m()[j], m[j]) << "step " << step << " element " << j;
    }
  }
  // A replica refuses bytes for a partition that sits the step out.
  Replica replica(c, Range{0, 256});
  std::vector<uint8_t> bytes(4 * 256);
  EXPECT_FALSE(replica.ApplyReply(1, 0, 256, bytes).ok());
  EXPECT_TRUE(replica.ApplyReply(1, 0, 256, {}).ok());
}

TEST(OptimizerTest, StreamingDilocoFragmentsMustDivideStepsAndPartitions) {
  AlgorithmConfig c = StreamingConfig();
  c.diloco.sync_every = 6;
  c.diloco.fragments = 4;  // does not divide 6
  EXPECT_NE(ValidateAlgorithmConfig(c).message().find("divide sync_every"),
            std::string::npos);
  c.diloco.sync_every = 6;
  c.diloco.fragments = 3;  // divides 6, not the 4 partitions
  EXPECT_NE(ValidateAlgorithmConfig(c).message().find("partitions (4)"),
            std::string::npos);
  c.diloco.fragments = 0;
  EXPECT_FALSE(ValidateAlgorithmConfig(c).ok());
  c.diloco.fragments = 2;
  EXPECT_TRUE(ValidateAlgorithmConfig(c).ok());
  // One fragment is plain DiLoCo, with its fingerprint.
  AlgorithmConfig one = c;
  one.diloco.fragments = 1;
  AlgorithmConfig plain = c;
  EXPECT_NE(AlgorithmFingerprint(one), AlgorithmFingerprint(plain));
  plain.diloco = DilocoSpec{};
  plain.diloco.sync_every = 6;
  EXPECT_EQ(AlgorithmFingerprint(one), AlgorithmFingerprint(plain));
}

// diloco's merge of an outer step's reply into a worker's own parameters
// (MergeOuter, design.md 2.11), against the rule written out: the partitions
// the step synced become the outer ones (mixing 0) or mixing * local +
// (1 - mixing) * outer; the idle fragment's stay; before step 0 all of them
// take the outer ones.
TEST(OptimizerTest, MergeOuterMixesTheSyncedPartitions) {
  AlgorithmConfig c = StreamingConfig();
  c.diloco.sync_every = 4;
  c.diloco.fragments = 2;
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  const uint64_t n = c.layout.dim;
  std::vector<float> outer(n), mine(n);
  for (uint64_t j = 0; j < n; ++j) {
    outer[j] = 0.37f * static_cast<float>(j % 13) - 1.1f;
    mine[j] = 0.011f * static_cast<float>(j) + 0.3f;
  }
  for (const float mixing : {0.0f, 0.5f, 0.3f}) {
    c.diloco.mixing = mixing;
    for (const int64_t step : {int64_t{-1}, int64_t{4}, int64_t{5}}) {
      std::vector<float> local = mine;
      MergeOuter(c, *layout, step, outer, absl::MakeSpan(local));
      const float rest = 1.0f - mixing;
      for (const Partition& p : layout->partitions()) {
        const bool synced = step < 0 || p.id % 2 == step % 2;
        for (uint64_t j = p.range.begin; j < p.range.end; ++j) {
          const float want = !synced       ? mine[j]
                             : step < 0    ? outer[j]
                             : mixing == 0 ? outer[j]
                                           : mixing * mine[j] + rest * outer[j];
          ASSERT_EQ(local[j], want)
              << "mixing " << mixing << " step " << step << " element " << j;
        }
      }
    }
  }
}

// overlap_steps and mixing: a reply is applied before the next exchange
// begins, and a mix is a convex one; zero leaves the fingerprint of a job
// without them.
TEST(OptimizerTest, DilocoOverlapAndMixingAreChecked) {
  AlgorithmConfig c = StreamingConfig();
  c.diloco.sync_every = 6;
  c.diloco.fragments = 2;  // 3 inner steps per outer step
  const uint64_t plain = AlgorithmFingerprint(c);
  c.diloco.overlap_steps = 3;
  EXPECT_NE(ValidateAlgorithmConfig(c).message().find(
                "overlap_steps must be in [0, sync_every / fragments = 3)"),
            std::string::npos)
      << ValidateAlgorithmConfig(c);
  c.diloco.overlap_steps = -1;
  EXPECT_FALSE(ValidateAlgorithmConfig(c).ok());
  c.diloco.overlap_steps = 2;
  EXPECT_TRUE(ValidateAlgorithmConfig(c).ok()) << ValidateAlgorithmConfig(c);
  const uint64_t overlapped = AlgorithmFingerprint(c);
  EXPECT_NE(overlapped, plain);
  for (const float bad : {1.0f, -0.1f, std::nanf("")}) {
    c.diloco.mixing = bad;
    EXPECT_NE(ValidateAlgorithmConfig(c).message().find("mixing must be in"),
              std::string::npos)
        << bad;
  }
  c.diloco.mixing = 0.5f;
  EXPECT_TRUE(ValidateAlgorithmConfig(c).ok());
  EXPECT_NE(AlgorithmFingerprint(c), overlapped);
  c.diloco.overlap_steps = 0;
  c.diloco.mixing = 0.0f;
  EXPECT_EQ(AlgorithmFingerprint(c), plain);
}

TEST(LayoutTest, PartitionIndexAtMatchesTheLayout) {
  for (const LayoutSpec& spec :
       {LayoutSpec{1000, 2, 16, 256}, LayoutSpec{1000, 3, 16, 64},
        LayoutSpec{17, 1, 16, 16}, LayoutSpec{5000, 7, 32, 96}}) {
    auto layout = Layout::Create(spec);
    ASSERT_TRUE(layout.ok());
    EXPECT_EQ(PartitionCount(spec), layout->partitions().size());
    for (const Partition& p : layout->partitions()) {
      EXPECT_EQ(PartitionIndexAt(spec, p.range.begin), p.id);
      EXPECT_EQ(PartitionIndexAt(spec, p.range.end - 1), p.id);
    }
  }
}

}  // namespace
}  // namespace morse::compress
