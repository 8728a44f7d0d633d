// End to end with real processes on loopback: 2 morse-server shards and 4
// morse-worker processes, several partitions per shard and an odd D. After
// every step every worker's x, m, v and every server's mirror must be
// bit-identical to the single-process simulator fed the same gradients.
#include <cstdio>
#include <vector>

#include "absl/strings/str_format.h"
#include "compress/kernels.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/expected.h"
#include "worker/workload.h"

namespace morse {
namespace {

using testing::Cluster;
using testing::Expected;
using testing::JsonField;
using testing::ReadFile;
using testing::Simulate;

// The CPU kernel table (MORSE_SIMD) each shard and each worker is forced to;
// empty: each picks the widest its CPU runs.
struct KernelTables {
  std::vector<std::string> shards, workers;
};

// What a process forced to `wanted` runs: that table, or the scalar one where
// the CPU cannot run it (compress/kernels.cc).
std::string TableRun(const std::string& wanted) {
  const compress::KernelTable* table =
      wanted == "avx512" ? compress::Avx512Kernels()
      : wanted == "avx2" ? compress::Avx2Kernels()
                         : nullptr;
  return table != nullptr ? wanted : "scalar";
}

// `daemon_args`: appended to every server's and worker's command line.
void ExpectBitIdentical(const std::string& config,
                        const std::vector<std::string>& daemon_args = {},
                        const KernelTables& tables = {}) {
  auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const Expected expected = Simulate(*job);
  Cluster cluster(config, job->shards(), job->workers());
  cluster.AddServerArgs(daemon_args);
  cluster.AddWorkerArgs(daemon_args);
  for (size_t s = 0; s < tables.shards.size(); ++s)
    cluster.SetServerEnv(s, {"MORSE_SIMD=" + tables.shards[s]});
  for (size_t r = 0; r < tables.workers.size(); ++r)
    cluster.SetWorkerEnv(r, {"MORSE_SIMD=" + tables.workers[r]});
  cluster.StartServers(/*state_logs=*/true);
  cluster.StartWorkers(/*checksums=*/true);
  std::string failure;
  ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(120), &failure)) << failure;
  cluster.StopServers();
  for (uint32_t r = 0; r < job->workers(); ++r) {
    const auto got = JsonField(ReadFile(cluster.worker_metrics(r)), "checksum");
    ASSERT_EQ(got.size(), expected.worker[r].size()) << "worker " << r;
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.worker[r][t])
          << "worker " << r << " differs at step " << t;
    }
  }
  for (uint32_t s = 0; s < job->shards(); ++s) {
    ASSERT_NO_FATAL_FAILURE(testing::ExpectStateLogMatches(
        ReadFile(cluster.state_log(s)), expected, s));
  }
  // The forced tables did run (the summary's "kernels", the server's first
  // line).
  for (size_t r = 0; r < tables.workers.size(); ++r) {
    const auto used = JsonField(ReadFile(cluster.worker_log(r)), "kernels");
    ASSERT_FALSE(used.empty()) << ReadFile(cluster.worker_log(r));
    EXPECT_EQ(used.back(), TableRun(tables.workers[r])) << "worker " << r;
  }
  for (size_t s = 0; s < tables.shards.size(); ++s) {
    const std::string log = ReadFile(cluster.server_log(s));
    EXPECT_NE(log.find(", " + TableRun(tables.shards[s]) + " kernels;"),
              std::string::npos)
        << "shard " << s << ": " << log.substr(0, 2000);
  }
  std::printf(
      "%zu steps (%zu exchanged): %u workers and %u server mirrors "
      "bit-identical to the "
      "simulator\n",
      expected.model.size(), expected.exchanged_steps.size(), job->workers(),
      job->shards());
}

// D = 20011: 79 blocks of 256 -> shards of 40 and 39 blocks, 3 partitions of
// up to 4096 elements each; the last block and partition are short.
constexpr char kCommon[] = R"(
  workers: 4
  shards: 2
  synthetic { dim: 20011 noise: 0.2 }
  lr { lr: 0.01 }
  steps: 12
  block_elems: 256
  partition_elems: 4096
  seed: 42
  log_every: 4
  window: 2
)";

TEST(TrainingTest, OneBitAdamAcrossTheFreezeStepMatchesTheSimulator) {
  ExpectBitIdentical(std::string(kCommon) + R"(
    optimizer: "onebit_adam"
    freeze_step: 5
  )");
}

// Nodes (local_ranks 2): 2 morse-worker processes, each a node of 2 local
// ranks, are the job's 2 workers; both and the shards' mirrors hold the
// simulator's bits with N = 2 fed each node's average of its local ranks'
// gradients (the average's rule: workload_test).
TEST(TrainingTest, NodesOfTwoLocalRanksMatchTheSimulator) {
  ExpectBitIdentical(R"(
    workers: 2
    local_ranks: 2
    shards: 2
    synthetic { dim: 20011 noise: 0.2 }
    lr { lr: 0.01 }
    steps: 10
    block_elems: 256
    partition_elems: 4096
    seed: 42
    log_every: 5
    optimizer: "onebit_adam"
    freeze_step: 4
  )");
}

// The compute pools (--compute_threads) of servers and workers complete,
// encode and apply partitions in parallel: the same bits with 1, 2 or 8
// threads (the other tests run with the default, one per core).
TEST(TrainingTest, ComputePoolsOfOneTwoOrEightThreadsMatchTheSimulator) {
  std::string config(kCommon);
  config.replace(config.find("noise: 0.2 }"), 12, "noise: 0.2 dead_every: 7 }");
  for (const char* threads : {"1", "2", "8"}) {
    SCOPED_TRACE(threads);
    ExpectBitIdentical(config + R"(
      optimizer: "onebit_adam"
      freeze_step: 5
    )",
                       {"--compute_threads", threads});
  }
}

// Dead elements (v = 0 at the freeze): the zero-variance mask and bias
// correction (both on by default) on workers, mirrors and recompression; and
// both off, DeepSpeed's OnebitAdam.
TEST(TrainingTest,
     OneBitAdamWithDeadUnitsMatchesTheSimulatorWithAndWithoutItsOptions) {
  std::string config(kCommon);
  config.replace(config.find("noise: 0.2 }"), 12, "noise: 0.2 dead_every: 7 }");
  ExpectBitIdentical(config + R"(
    optimizer: "onebit_adam"
    freeze_step: 5
  )");
  ExpectBitIdentical(config + R"(
    optimizer: "onebit_adam"
    freeze_step: 5
    adam { eps: 1e-4 bias_correction: false }
    mask_zero_variance: false
  )");
}

// 0/1 Adam (docs/design.md 2.7) across every phase change: variance steps
// at s = 1, 2, 4, 6, 8 with 1-bit steps between them, then the local phase
// from step 8 with intervals 1, 2 and 4 (workers step on their own and the
// shards see only the syncs), with dead units (the mask) and weight decay
// (folded into the sync). Then with clipping and bias correction off.
TEST(TrainingTest, ZeroOneAdamAcrossEveryPhaseMatchesTheSimulator) {
  std::string config(kCommon);
  config.replace(config.find("noise: 0.2 }"), 12, "noise: 0.2 dead_every: 7 }");
  config.replace(config.find("steps: 12"), 9, "steps: 26");
  config += R"(
    optimizer: "zero_one_adam"
    zero_one_adam { var_freeze_step: 8 var_update_scaler: 2 local_step_scaler: 3 local_step_clipper: 4 }
  )";
  ExpectBitIdentical(config + "adam { weight_decay: 0.01 }\n");
  ExpectBitIdentical(config +
                     "adam { bias_correction: false }\nclip_grad_norm: 0.5\n");
}

// kCommon with dead units and 1-bit LAMB's layers of 3000 elements (which
// cross partitions and both shards), frozen at step 5.
std::string LayeredLamb() {
  std::string config(kCommon);
  config.replace(config.find("noise: 0.2 }"), 12,
                 "noise: 0.2 dead_every: 7 layer_elems: 3000 }");
  return config + "optimizer: \"onebit_lamb\"\nfreeze_step: 5\n";
}

// 1-bit LAMB (docs/design.md 2.8) across the freeze: layers of 3000
// elements cross partitions and both shards, so every mirror moves x only
// with the coefficients the workers commit (rank 0's Commit, or the next
// pushes). With dead units and weight decay; then without bias correction
// and with other coefficient bounds.
TEST(TrainingTest, OneBitLambAcrossTheFreezeMatchesTheSimulator) {
  const std::string config = LayeredLamb();
  // The layers matter: one layer of the whole model trains differently.
  std::string one_layer = config;
  one_layer.replace(one_layer.find(" layer_elems: 3000"), 18, "");
  const auto layered =
      proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  const auto whole =
      proto::ParseJobConfig(one_layer, proto::ConfigFormat::kText);
  ASSERT_TRUE(layered.ok() && whole.ok()) << layered.status() << whole.status();
  ASSERT_EQ(layered->algorithm.layers.size(), 7u);
  EXPECT_NE(Simulate(*layered).model.back(), Simulate(*whole).model.back());
  ExpectBitIdentical(config + "adam { weight_decay: 0.01 }\n");
  ExpectBitIdentical(config + R"(
    adam { bias_correction: false }
    onebit_lamb { max_coeff: 0.5 min_coeff: 0.05 coeff_beta: 0.5 factor_threshold: 0.2 }
  )");
}

TEST(TrainingTest, LocoInt4EmaMatchesTheSimulator) {
  ExpectBitIdentical(std::string(kCommon) + R"(
    optimizer: "adam"
    up_codec { codec: "int4" stochastic: true }
    down_codec { codec: "int4" }
    worker_feedback { mode: "ema" beta: 0.5 }
    server_feedback { mode: "ema" beta: 0.5 }
  )");
}

// Gradient clipping (clip_grad_norm) on workers, server mirrors and the
// simulator alike: 1-bit Adam across the freeze (the averaged gradient
// clipped in warmup, through the replies' norms and Commit; each worker's
// own gradient after the freeze) and adam with LoCo's int4 (every step
// clips the average). The norm is far above 0.5, so every step clips.
TEST(TrainingTest, ClippingMatchesTheSimulator) {
  const std::string onebit = std::string(kCommon) + R"(
    optimizer: "onebit_adam"
    freeze_step: 5
  )";
  const std::string loco = std::string(kCommon) + R"(
    optimizer: "adam"
    up_codec { codec: "int4" stochastic: true }
    down_codec { codec: "int4" }
    worker_feedback { mode: "ema" beta: 0.5 }
    server_feedback { mode: "ema" beta: 0.5 }
  )";
  const std::string lamb = LayeredLamb() + "adam { weight_decay: 0.01 }\n";
  for (const std::string& config : {onebit, loco, lamb}) {
    SCOPED_TRACE(config);
    const std::string clipped = config + "clip_grad_norm: 0.5\n";
    const auto with =
        proto::ParseJobConfig(clipped, proto::ConfigFormat::kText);
    const auto without =
        proto::ParseJobConfig(config, proto::ConfigFormat::kText);
    ASSERT_TRUE(with.ok() && without.ok()) << with.status();
    EXPECT_NE(Simulate(*with).model.back(),
              Simulate(*without).model.back());  // it clips
    ExpectBitIdentical(clipped);
  }
}

// Morse's own arithmetic gives the same bits on every CPU (issue 34): a job
// whose shards and workers each run another kernel table (scalar, AVX2,
// AVX-512; MORSE_SIMD), at an odd D whose last block ends inside a vector,
// against the simulator in this process (the widest table here), for every
// optimizer and codec family. A table this CPU lacks runs scalar (said in
// the output); tests/compress/kernels_test compares each table with the
// scalar one kernel by kernel.
TEST(TrainingTest, EveryKernelTableGivesTheSameBits) {
  const KernelTables tables{{"scalar", "avx512"},
                            {"avx512", "scalar", "avx2", "avx2"}};
  std::printf(
      "kernel tables here: shards %s, %s; workers %s, %s, %s, %s\n",
      TableRun(tables.shards[0]).c_str(), TableRun(tables.shards[1]).c_str(),
      TableRun(tables.workers[0]).c_str(), TableRun(tables.workers[1]).c_str(),
      TableRun(tables.workers[2]).c_str(), TableRun(tables.workers[3]).c_str());
  std::string dead(kCommon);
  dead.replace(dead.find("noise: 0.2 }"), 12, "noise: 0.2 dead_every: 7 }");
  std::string layered(kCommon);
  layered.replace(layered.find("noise: 0.2 }"), 12,
                  "noise: 0.2 dead_every: 7 layer_elems: 3000 }");
  std::string zero_one = dead;
  zero_one.replace(zero_one.find("steps: 12"), 9, "steps: 20");
  const std::string configs[] = {
      dead + R"(
        optimizer: "onebit_adam"
        freeze_step: 5
        clip_grad_norm: 0.5
      )",
      zero_one + R"(
        optimizer: "zero_one_adam"
        zero_one_adam { var_freeze_step: 8 var_update_scaler: 2 local_step_scaler: 3 local_step_clipper: 4 }
      )",
      layered + R"(
        optimizer: "onebit_lamb"
        freeze_step: 5
        adam { weight_decay: 0.01 }
      )",
      std::string(kCommon) + R"(
        optimizer: "adam"
        up_codec { codec: "int4" stochastic: true }
        down_codec { codec: "int8" }
        worker_feedback { mode: "ema" beta: 0.5 }
        server_feedback { mode: "ef" }
      )",
  };
  for (const std::string& config : configs) {
    SCOPED_TRACE(config);
    ExpectBitIdentical(config, {}, tables);
  }
}

TEST(TrainingTest, AWorkerStartedBeforeItsServersWaitsAndTrains) {
  const std::string config = R"(
    workers: 1
    shards: 2
    synthetic { dim: 20011 }
    lr { lr: 0.01 }
    steps: 12
    freeze_step: 2
    block_elems: 256
    partition_elems: 4096
  )";
  Cluster cluster(config, 2, 1);
  cluster.StartWorker(0, false);
  absl::SleepFor(absl::Milliseconds(1500));
  cluster.StartServers(false);
  std::string failure;
  ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(60), &failure)) << failure;
  const std::string log = ReadFile(cluster.worker_log(0));
  EXPECT_NE(log.find("waiting for servers"), std::string::npos) << log;
  EXPECT_NE(log.find("\"steps\":12"), std::string::npos) << log;
}

}  // namespace
}  // namespace morse
