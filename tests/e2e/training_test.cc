// End to end with real processes on loopback: 2 morse-server shards and 4
// morse-worker processes, several partitions per shard and an odd D. After
// every step every worker's x, m, v and every server's mirror must be
// bit-identical to the single-process simulator fed the same gradients.
#include <cstdio>
#include <vector>

#include "absl/strings/str_format.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/e2e/cluster.h"
#include "worker/workload.h"

namespace morse {
namespace {

using testing::Cluster;
using testing::JsonField;
using testing::ReadFile;

struct Expected {
  std::vector<std::string> model;               // per step, all of x, m, v
  std::vector<std::vector<std::string>> shard;  // [shard][step]
};

// Runs the simulator on the synthetic workload's gradients and records the
// checksums a worker and each shard should report after every step.
Expected Simulate(const proto::JobSpec& job) {
  const uint64_t dim = job.algorithm.layout.dim;
  auto sim = compress::Simulator::Create(job.algorithm, std::vector<float>(dim, 0.0f));
  EXPECT_TRUE(sim.ok()) << sim.status();
  std::vector<worker::SyntheticWorkload> workloads;
  for (uint32_t r = 0; r < job.workers(); ++r) workloads.emplace_back(job, r);
  std::vector<std::vector<float>> grads(job.workers(), std::vector<float>(dim));
  Expected expected;
  expected.shard.resize(job.shards());
  const auto hex = [](uint64_t v) { return absl::StrFormat("%016x", v); };
  for (int64_t step = 0; step < job.steps; ++step) {
    for (uint32_t r = 0; r < job.workers(); ++r) {
      EXPECT_TRUE(workloads[r].Gradient(step, sim->x(), absl::MakeSpan(grads[r])).ok());
    }
    std::vector<absl::Span<const float>> views(grads.begin(), grads.end());
    EXPECT_TRUE(sim->Step(views).ok());
    expected.model.push_back(hex(compress::StateChecksum({sim->x(), sim->m(), sim->v()})));
    for (uint32_t s = 0; s < job.shards(); ++s) {
      const compress::Range r = sim->layout().shard_range(s);
      expected.shard[s].push_back(hex(compress::StateChecksum(
          {sim->x().subspan(r.begin, r.size()), sim->m().subspan(r.begin, r.size()),
           sim->v().subspan(r.begin, r.size())})));
    }
  }
  return expected;
}

void ExpectBitIdentical(const std::string& config) {
  auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const Expected expected = Simulate(*job);
  Cluster cluster(config, job->shards(), job->workers());
  cluster.StartServers(/*state_logs=*/true);
  cluster.StartWorkers(/*checksums=*/true);
  std::string failure;
  ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(120), &failure)) << failure;
  cluster.StopServers();
  for (uint32_t r = 0; r < job->workers(); ++r) {
    const auto got = JsonField(ReadFile(cluster.worker_metrics(r)), "checksum");
    ASSERT_EQ(got.size(), expected.model.size()) << "worker " << r;
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.model[t]) << "worker " << r << " differs at step " << t;
    }
  }
  for (uint32_t s = 0; s < job->shards(); ++s) {
    const auto got = JsonField(ReadFile(cluster.state_log(s)), "mirror_checksum");
    ASSERT_EQ(got.size(), expected.shard[s].size()) << "shard " << s;
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.shard[s][t]) << "shard " << s << " mirror differs at step " << t;
    }
  }
  std::printf("%zu steps: %u workers and %u server mirrors bit-identical to the simulator\n",
              expected.model.size(), job->workers(), job->shards());
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

TEST(TrainingTest, LocoInt4EmaMatchesTheSimulator) {
  ExpectBitIdentical(std::string(kCommon) + R"(
    optimizer: "adam"
    up_codec { codec: "int4" stochastic: true }
    down_codec { codec: "int4" }
    worker_feedback { mode: "ema" beta: 0.5 }
    server_feedback { mode: "ema" beta: 0.5 }
  )");
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
