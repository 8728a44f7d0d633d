#include "proto/job_config.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace morse::proto {
namespace {

constexpr char kMinimal[] = R"(
  workers: 4
  shards: 2
  synthetic { dim: 100000 }
  lr { lr: 0.001 }
  steps: 100
  freeze_step: 20
)";

TEST(JobConfigTest, DefaultsForOneBitAdam) {
  auto job = ParseJobConfig(kMinimal, ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const auto& a = job->algorithm;
  EXPECT_EQ(a.optimizer, compress::OptimizerKind::kOneBitAdam);
  EXPECT_EQ(a.up_codec.kind, compress::CodecKind::kSign1);
  EXPECT_EQ(a.down_codec.kind, compress::CodecKind::kSign1);
  EXPECT_EQ(a.warmup_codec.kind, compress::CodecKind::kFp32);
  EXPECT_EQ(a.worker_feedback.kind, compress::FeedbackKind::kEf);
  EXPECT_EQ(a.server_feedback.kind, compress::FeedbackKind::kEf);
  EXPECT_TRUE(
      a.bias_correction);  // DESIGN 2.1: on by default for onebit_adam too
  EXPECT_TRUE(a.mask_zero_variance);
  EXPECT_TRUE(a.bound_update);
  EXPECT_EQ(a.layout.block_elems, 2048u);
  // 50,000 elements a shard: the smallest default partition.
  EXPECT_EQ(a.layout.partition_elems, 65536u);
  EXPECT_FLOAT_EQ(a.adam.beta1, 0.9f);
  EXPECT_EQ(job->channels_per_shard, 2u);
  EXPECT_EQ(job->uploads_per_shard, 1u);
}

// The layout a two-shard Adam job with `rest` compiles to ({} and a
// failure if it does not compile).
compress::LayoutSpec LayoutOf(const std::string& rest) {
  auto job = ParseJobConfig(
      "workers: 2 shards: 2 steps: 10 lr { lr: 0.01 } optimizer: \"adam\" " +
          rest,
      ConfigFormat::kText);
  EXPECT_TRUE(job.ok()) << job.status();
  return job.ok() ? job->algorithm.layout : compress::LayoutSpec{};
}

// Unset, partition_elems follows the model's size (compress::
// DefaultPartitionElems); set, it is kept; a server's base config for an
// external model, whose size comes later, takes the largest default.
TEST(JobConfigTest, ThePartitionSizeFollowsTheModelUnlessSet) {
  auto sized = [](const std::string& rest) {
    return LayoutOf(rest).partition_elems;
  };
  EXPECT_EQ(sized("synthetic { dim: 1000000 }"), 65536u);
  EXPECT_EQ(sized("synthetic { dim: 10000000 }"), 626688u);
  EXPECT_EQ(sized("synthetic { dim: 25000000 }"), 1u << 20);
  EXPECT_EQ(sized("synthetic { dim: 25000000 } partition_elems: 4096"), 4096u);
  EXPECT_EQ(sized("external { dim: 10000000 }"), 626688u);
  EXPECT_EQ(sized("external {}"), 1u << 20);
  EXPECT_EQ(sized("external {} block_elems: 3008"), 1049792u);
}

// Unset, block_elems is 2048 unless the model is too small to give every
// shard a block of 2048 (compress::DefaultBlockElems; such a layout was
// refused); set, it is kept.
TEST(JobConfigTest, TheBlockSizeShrinksForAModelTooSmallForItsShards) {
  auto blocked = [](const std::string& rest) {
    return LayoutOf(rest).block_elems;
  };
  EXPECT_EQ(blocked("synthetic { dim: 1000000 }"), 2048u);
  EXPECT_EQ(blocked("external { dim: 2048 }"), 1024u);
  EXPECT_EQ(blocked("external {}"), 2048u);  // a server's, size to come
  EXPECT_EQ(blocked("synthetic { dim: 100 }"), 64u);
  EXPECT_EQ(blocked("synthetic { dim: 4095 }"), 2048u);  // as it was
  auto set = ParseJobConfig(
      "workers: 2 shards: 2 steps: 10 lr { lr: 0.01 } optimizer: \"adam\" "
      "synthetic { dim: 2048 } block_elems: 2048",
      ConfigFormat::kText);
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.status().message().find("every shard needs a block"),
            std::string::npos)
      << set.status();
}

TEST(JobConfigTest, AdamDefaultsAndJson) {
  auto job = ParseJobConfig(
      R"({"workers": 2, "shards": 1, "mlp": {"trainPath": "t.csv",
      "features": 64, "classes": 10, "hidden": [32, 16]}, "optimizer": "adam",
      "lr": {"lr": 0.01}, "steps": 10, "upCodec": {"codec": "int4"},
      "workerFeedback": {"mode": "ema", "beta": 0.5}})",
      ConfigFormat::kJson);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(job->algorithm.bias_correction);
  EXPECT_EQ(job->algorithm.up_codec.kind, compress::CodecKind::kInt4);
  EXPECT_EQ(job->algorithm.down_codec.kind,
            compress::CodecKind::kInt4);  // follows up
  EXPECT_EQ(job->algorithm.server_feedback.kind,
            compress::FeedbackKind::kEma);  // follows worker
  EXPECT_EQ(job->algorithm.layout.dim,
            64u * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10);
}

TEST(JobConfigTest, ErrorsNameTheField) {
  const struct {
    const char* text;
    const char* field;
  } cases[] = {
      {"workers: 0 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1",
       "workers"},
      {"workers: 1 shards: 1 lr { lr: 1 } steps: 1", "workload"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 0 } steps: 1",
       "lr"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"sgd\"",
       "optimizer"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "up_codec { codec: \"int3\" }",
       "up_codec"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "warmup_codec { codec: \"sign1\" }",
       "job"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "block_elems: 24",
       "block_elems"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"adam\" window: 0",
       "window"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"adam\" uploads_per_shard: 1025",
       "uploads_per_shard"},
      {"workers: 1 shards: 9 synthetic { dim: 10 } lr { lr: 1 } steps: 1",
       "shards"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 5 "
       "freeze_step: 9",
       "freeze_step"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "worker_feedback { mode: \"ema\" beta: 2 }",
       "worker_feedback"},
      {"workers: 1 shards: 1 mlp { train_path: \"x\" } lr { lr: 1 } steps: 1",
       "mlp.features"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"adam\" mask_zero_variance: true",
       "mask_zero_variance"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"adam\" bound_update: true",
       "bound_update"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "worker_feedback { mode: \"ef\" beta: 0.5 }",
       "worker_feedback"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "worker_feedback { mode: \"ema\" beta: 0 }",
       "worker_feedback"},
      {"workers: 1 shards: 1 synthetic { dim: 10 layer_elems: 5 } lr { lr: 1 } "
       "steps: 1",
       "synthetic.layer_elems"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "diloco { sync_every: 4 }",
       "diloco"},
      // Each optimizer's own section, set for another (the section table).
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"adam\" onebit_lamb { max_coeff: 2 }",
       "onebit_lamb"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
       "optimizer: \"onebit_lamb\" zero_one_adam { var_freeze_step: 2 }",
       "zero_one_adam"},
      {"workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 5 "
       "optimizer: \"zero_one_adam\" freeze_step: 1",
       "freeze_step"},
      {"workers: 1 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
       "optimizer: \"diloco\" diloco { outer_momentum: 1 }",
       "outer_momentum"},
      // Parameter groups: sizes that add up to dim, on blocks, for the
      // optimizers that read lr and weight_decay per partition.
      {"workers: 1 shards: 1 external { dim: 64 groups: 32 groups: 16 } "
       "lr { lr: 1 } steps: 1 optimizer: \"adam\" block_elems: 16",
       "external.groups"},
      {"workers: 1 shards: 1 external { dim: 64 groups: 64 groups: 0 } "
       "lr { lr: 1 } steps: 1 optimizer: \"adam\" block_elems: 16",
       "external.groups"},
      {"workers: 1 shards: 1 external { dim: 64 groups: 24 groups: 40 } "
       "lr { lr: 1 } steps: 1 optimizer: \"adam\" block_elems: 16",
       "external.groups"},
      // diloco's outer step takes one lr for the whole model.
      {"workers: 1 shards: 1 external { dim: 64 groups: 32 groups: 32 } "
       "lr { lr: 1 } steps: 2 optimizer: \"diloco\" block_elems: 16",
       "external.groups"},
      // onebit_lamb's groups start on layers (one lr per layer).
      {"workers: 1 shards: 1 external { dim: 64 groups: 32 groups: 32 } "
       "lr { lr: 1 } steps: 2 freeze_step: 1 optimizer: \"onebit_lamb\" "
       "block_elems: 16",
       "external.groups"},
      {"workers: 1 shards: 1 external { dim: 64 groups: 32 groups: 32 "
       "layers: 40 layers: 24 } lr { lr: 1 } steps: 2 freeze_step: 1 "
       "optimizer: \"onebit_lamb\" block_elems: 16",
       "external.groups"},
      {"workers: 1 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
       "optimizer: \"diloco\" clip_grad_norm: 1",
       "clip_grad_norm"},
      {"workers: 1 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
       "optimizer: \"diloco\" freeze_step: 1",
       "freeze_step"},
      {"workers: 1 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
       "optimizer: \"diloco\" warmup_codec { codec: \"bf16\" }",
       "warmup_codec"},
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 "
       "min_workers: 3",
       "min_workers"},
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 "
       "min_workers: 0",
       "min_workers"},
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 "
       "min_workers: 1 timeouts { step_seconds: 9 recovery_seconds: 9 }",
       "timeouts.step_seconds"},
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 timeouts { straggler_seconds: 0.1 }",
       "timeouts.straggler_seconds"},  // not elastic
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 min_workers: 1 "
       "timeouts { step_seconds: 1 straggler_seconds: 1 }",
       "timeouts.straggler_seconds"},  // not below step_seconds
      {"workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 2 "
       "freeze_step: 1 min_workers: 1 timeouts { straggler_seconds: -0.5 }",
       "timeouts.straggler_seconds"},
      // A model cut finer than compress::kMaxPartitions (the fuzzer's
      // find: 2 GiB of partition records), or larger than kMaxDim.
      {"workers: 1 shards: 1 synthetic { dim: 4000000000 } lr { lr: 1 } "
       "steps: 1 block_elems: 16 partition_elems: 16",
       "partition_elems"},
      {"workers: 1 shards: 1 external { dim: 18446744073709551615 } "
       "lr { lr: 1 } steps: 1",
       "dim"},
      {"workers: 1 bogus: 3", "bogus"},
  };
  for (const auto& c : cases) {
    auto job = ParseJobConfig(c.text, ConfigFormat::kText);
    ASSERT_FALSE(job.ok()) << c.text;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(job.status().message().find(c.field), absl::string_view::npos)
        << c.text << " -> " << job.status();
  }
}

TEST(JobConfigTest, UploadsPerShardZeroLiftsTheLimit) {
  auto job = ParseJobConfig(
      "workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
      "optimizer: \"adam\" uploads_per_shard: 0",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->uploads_per_shard, 0u);
}

// Unset, the window is the engine's to choose (0 here; Engine::
// DefaultWindow: 32 on the host, every partition on a GPU); set, it is kept.
TEST(JobConfigTest, TheWindowIsTheEnginesUnlessSet) {
  const std::string base =
      "workers: 2 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
      "optimizer: \"adam\" ";
  auto unset = ParseJobConfig(base, ConfigFormat::kText);
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(unset->window, 0u);
  auto set = ParseJobConfig(base + "window: 5", ConfigFormat::kText);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->window, 5u);
}

TEST(JobConfigTest, MinWorkersDefaultsToWorkers) {
  auto job = ParseJobConfig(
      "workers: 3 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
      "optimizer: \"adam\"",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->min_workers, 3u);
  EXPECT_FALSE(job->elastic());
  job = ParseJobConfig(
      "workers: 3 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 1 "
      "optimizer: \"adam\" "
      "min_workers: 2",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->min_workers, 2u);
  EXPECT_TRUE(job->elastic());
}

TEST(JobConfigTest, ParameterGroupsCutTheLayout) {
  auto job = ParseJobConfig(
      "workers: 2 shards: 2 external { dim: 100 groups: 32 groups: 16 "
      "groups: 52 } lr { lr: 1 } steps: 1 optimizer: \"onebit_adam\" "
      "freeze_step: 1 block_elems: 16 partition_elems: 32",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->algorithm.layout.cuts, (std::vector<uint64_t>{32, 48}));
  // One group is no cut at all.
  job = ParseJobConfig(
      "workers: 2 shards: 2 external { dim: 100 groups: 100 } lr { lr: 1 } "
      "steps: 1 optimizer: \"adam\" block_elems: 16",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(job->algorithm.layout.cuts.empty());
  // onebit_lamb's groups of whole layers.
  job = ParseJobConfig(
      "workers: 2 shards: 2 external { dim: 100 groups: 32 groups: 68 "
      "layers: 20 layers: 12 layers: 68 } lr { lr: 1 } steps: 2 "
      "freeze_step: 1 optimizer: \"onebit_lamb\" block_elems: 16",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->algorithm.layout.cuts, (std::vector<uint64_t>{32}));
  // zero_one_adam's: each group's local steps and lr sum its own.
  job = ParseJobConfig(
      "workers: 2 shards: 2 external { dim: 100 groups: 32 groups: 68 } "
      "lr { lr: 1 } steps: 2 optimizer: \"zero_one_adam\" block_elems: 16",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->algorithm.layout.cuts, (std::vector<uint64_t>{32}));
}

TEST(JobConfigTest, DilocoDefaultsAreThePapers) {
  auto job = ParseJobConfig(
      "workers: 2 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
      "optimizer: \"diloco\"",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const compress::AlgorithmConfig& a = job->algorithm;
  EXPECT_EQ(a.optimizer, compress::OptimizerKind::kDiloco);
  EXPECT_EQ(a.diloco.sync_every, 500);
  EXPECT_EQ(a.diloco.outer_lr, 0.7f);
  EXPECT_EQ(a.diloco.outer_momentum, 0.9f);
  EXPECT_TRUE(a.diloco.nesterov);
  EXPECT_EQ(a.up_codec.kind, compress::CodecKind::kFp32);
  EXPECT_EQ(a.worker_feedback.kind, compress::FeedbackKind::kNone);
  job = ParseJobConfig(
      "workers: 2 shards: 1 external { dim: 16 } lr { lr: 1 } steps: 1 "
      "optimizer: \"diloco\" diloco { sync_every: 100 outer_lr: 1 "
      "outer_momentum: 0 nesterov: false } up_codec { codec: \"int4\" } "
      "worker_feedback { mode: \"ef\" }",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->algorithm.diloco.sync_every, 100);
  EXPECT_EQ(job->algorithm.diloco.outer_lr, 1.0f);
  EXPECT_EQ(job->algorithm.diloco.outer_momentum, 0.0f);
  EXPECT_FALSE(job->algorithm.diloco.nesterov);
  EXPECT_EQ(job->algorithm.up_codec.kind, compress::CodecKind::kInt4);
}

TEST(JobConfigTest, OneBitOptionsCanBeTurnedOff) {
  auto job = ParseJobConfig(
      "workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 4 "
      "freeze_step: 2 "
      "adam { bias_correction: false } mask_zero_variance: false bound_update: "
      "false",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_FALSE(job->algorithm.bias_correction);
  EXPECT_FALSE(job->algorithm.mask_zero_variance);
  EXPECT_FALSE(job->algorithm.bound_update);
}

TEST(JobConfigTest, EmaWithoutBetaIsHalf) {
  auto job = ParseJobConfig(
      "workers: 1 shards: 1 synthetic { dim: 10 } lr { lr: 1 } steps: 4 "
      "optimizer: \"adam\" "
      "up_codec { codec: \"int4\" } worker_feedback { mode: \"ema\" }",
      ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->algorithm.worker_feedback.kind, compress::FeedbackKind::kEma);
  EXPECT_EQ(job->algorithm.worker_feedback.beta, 0.5f);
}

// The memory check counts the pushes a worker retains and the replies a
// shard keeps for replay (replay_steps each), over the job's first
// replay_steps steps: fp32 in 1-bit Adam's warmup, then 1 bit.
TEST(JobConfigTest, StateBytesCountWhatIsKeptForReplay) {
  const auto job = [](const std::string& checkpoint, int freeze = 10) {
    auto parsed = ParseJobConfig(
        absl::StrCat(
            "workers: 2 shards: 1 synthetic { dim: 4194304 } lr { lr: 1 } "
            "steps: 100 optimizer: \"onebit_adam\" freeze_step: ",
            freeze, " ", checkpoint),
        ConfigFormat::kText);
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    return *parsed;
  };
  const JobSpec none = job(""), kept = job("checkpoint { every_steps: 9 }");
  ASSERT_EQ(none.replay_steps, 0u);
  ASSERT_EQ(kept.replay_steps, 10u);
  const uint64_t dim = 4194304, fp32_steps = 10 * 4 * dim;
  const uint64_t worker_extra = WorkerStateBytes(kept) - WorkerStateBytes(none);
  EXPECT_GE(worker_extra, fp32_steps);
  EXPECT_LE(worker_extra, fp32_steps * 11 / 10);
  const uint64_t shard_extra =
      ShardStateBytes(kept, dim) - ShardStateBytes(none, dim);
  EXPECT_GE(shard_extra, fp32_steps);
  EXPECT_LE(shard_extra, fp32_steps * 11 / 10);
  // A warmup of 2 steps: 2 fp32 steps and 8 of 1 bit are kept at most.
  const JobSpec short_warmup = job("checkpoint { every_steps: 9 }", 2),
                short_none = job("", 2);
  const uint64_t short_extra =
      WorkerStateBytes(short_warmup) - WorkerStateBytes(short_none);
  EXPECT_GE(short_extra, 2 * 4 * dim + 8 * dim / 8);
  EXPECT_LE(short_extra, (2 * 4 * dim + 8 * dim / 8) * 11 / 10);
  // An absurd retention saturates instead of wrapping round.
  JobSpec absurd = kept;
  absurd.replay_steps = 4000000000u;
  absurd.algorithm.layout.dim = uint64_t{1} << 62;
  EXPECT_EQ(WorkerStateBytes(absurd), UINT64_MAX);
  EXPECT_FALSE(
      CheckFitsInMemory(WorkerStateBytes(absurd), "worker", uint64_t{1} << 40)
          .ok());
}

TEST(JobConfigTest, MissingFileIsNotFound) {
  const absl::Status missing =
      LoadJobConfig("/nonexistent/job.textproto").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(missing.message(), "No such file or directory"))
      << missing;
}

// A folder given for the config is refused as one, not read as a config of
// defaults (which failed on `workers`, a field the user never wrote).
TEST(JobConfigTest, AFolderIsNoConfigFile) {
  const absl::Status folder = LoadJobConfig(::testing::TempDir()).status();
  EXPECT_EQ(folder.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(folder.message(), "is a directory")) << folder;
}

// An empty file (a ConfigMap's key missing) says so, not that `workers` is 0.
TEST(JobConfigTest, AnEmptyFileSaysItIsEmpty) {
  const std::string path =
      ::testing::TempDir() + "/job_config_test_empty.textproto";
  { std::ofstream(path) << " \n\t\n"; }
  const absl::Status empty = LoadJobConfig(path).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(empty.message(), "is empty")) << empty;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace morse::proto

#include "proto/wire.h"

namespace morse::proto {
namespace {

// The largest messages are RestorePartition's x, m, v and server error and
// onebit_lamb's FetchPartition (x, m, v, v' and the layers' state) of the
// largest partition (16 bytes an element); gRPC must allow them.
TEST(WireTest, MessageLimitHoldsAFetchedPartition) {
  for (const char* layout :
       {"partition_elems: 262144", "partition_elems: 1048576",
        "block_elems: 16 partition_elems: 64"}) {
    for (const char* optimizer :
         {"} ", "layer_elems: 100 } optimizer: \"onebit_lamb\" "}) {
      auto job = ParseJobConfig(
          absl::StrCat("workers: 1 shards: 1 synthetic { dim: 5000000 ",
                       optimizer, "lr { lr: 0.1 } steps: 1 freeze_step: 1 ",
                       layout),
          ConfigFormat::kText);
      ASSERT_TRUE(job.ok()) << job.status();
      const uint64_t largest = std::min<uint64_t>(
          job->algorithm.layout.partition_elems, job->algorithm.layout.dim);
      const uint64_t layers =
          job->algorithm.optimizer == compress::OptimizerKind::kOneBitLamb
              ? 50000
              : 0;
      EXPECT_GE(static_cast<uint64_t>(MaxMessageBytes(*job)),
                16 * largest + 24 * layers + 1024)
          << layout << optimizer;
    }
  }
}

}  // namespace
}  // namespace morse::proto
