// A mixed job (issue 4): rank 0 trains on the GPU (--device cuda: x, m, v,
// error buffer and gradient in device memory), rank 1 on the CPU, 2 shards,
// 1-bit Adam for 50 steps across the freeze step. Both workers and
// both server mirrors must be bit-identical to the simulator after every
// step. Skips, saying why, without a GPU.
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "proto/job_config.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/expected.h"

namespace morse {
namespace {

using testing::JsonField;
using testing::ReadFile;

TEST(GpuTest, CpuAndGpuWorkersStayBitIdenticalAcrossTheFreeze) {
  auto device = kernels::DeviceDescription();
  if (!device.ok()) GTEST_SKIP() << "no GPU here: " << device.status().message();
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 300007 noise: 0.3 }
    optimizer: "onebit_adam"
    adam { eps: 1e-4 }
    lr { lr: 0.01 }
    freeze_step: 10
    steps: 50
    block_elems: 256
    partition_elems: 65536
    seed: 3
  )";
  auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const testing::Expected expected = testing::Simulate(*job);
  testing::Cluster cluster(config, 2, 2);
  cluster.StartServers(/*state_logs=*/true);
  cluster.AddWorkerArgs({"--device=cuda"});
  cluster.StartWorker(0, /*checksums=*/true);
  cluster.AddWorkerArgs({"--device=cpu"});
  cluster.StartWorker(1, /*checksums=*/true);
  std::string failure;
  ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(180), &failure)) << failure;
  cluster.StopServers();
  EXPECT_NE(ReadFile(cluster.worker_log(0)).find("gradient on "), std::string::npos)
      << ReadFile(cluster.worker_log(0));
  for (int r = 0; r < 2; ++r) {
    const auto got = JsonField(ReadFile(cluster.worker_metrics(r)), "checksum");
    ASSERT_EQ(got.size(), expected.model.size()) << "worker " << r;
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.model[t]) << (r == 0 ? "GPU" : "CPU") << " worker differs at step " << t;
    }
  }
  for (int s = 0; s < 2; ++s) {
    const auto got = JsonField(ReadFile(cluster.state_log(s)), "mirror_checksum");
    ASSERT_EQ(got.size(), expected.shard[s].size());
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.shard[s][t]) << "shard " << s << " differs at step " << t;
    }
  }
}

}  // namespace
}  // namespace morse
