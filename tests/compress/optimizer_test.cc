// The optimizer seam (compress/optimizer.h): every optimizer found by its
// JobConfig name, its state arrays checked by name and size, and the
// algorithm fingerprints that checkpoints carry unchanged by the seam.
#include "compress/optimizer.h"

#include <string>
#include <vector>

#include "compress/replica.h"
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
  c.clip_grad_norm = kind == OptimizerKind::kOneBitLamb ? 0.0f : 1.5f;
  c.seed = 7;
  return c;
}

TEST(OptimizerTest, EveryOptimizerIsFoundByItsName) {
  for (OptimizerKind kind :
       {OptimizerKind::kOneBitAdam, OptimizerKind::kAdam,
        OptimizerKind::kZeroOneAdam, OptimizerKind::kOneBitLamb}) {
    const Optimizer& optimizer = OptimizerOf(kind);
    EXPECT_EQ(optimizer.kind(), kind);
    const Optimizer* found = FindOptimizer(optimizer.name());
    ASSERT_NE(found, nullptr) << optimizer.name();
    EXPECT_EQ(found, &optimizer);
    EXPECT_TRUE(optimizer.Validate(Config(kind)).ok()) << optimizer.name();
  }
  EXPECT_EQ(FindOptimizer("lamb"), nullptr);
  EXPECT_EQ(OptimizerNames(),
            "onebit_adam, adam, zero_one_adam or onebit_lamb");
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

}  // namespace
}  // namespace morse::compress
