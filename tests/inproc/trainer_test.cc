// worker::Trainer, morse-worker's step loop, driven a step at a time over
// the in-process cluster: what it reports per step (records, progress
// lines, the metrics file, checkpoints), its summary, and what it refuses.
#include "worker/trainer.h"


#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/e2e/expected.h"
#include "tests/inproc/cluster.h"

namespace morse::inproc {
namespace {

proto::JobSpec Job() {
  auto job = proto::ParseJobConfig(R"(
    workers: 1 shards: 2
    synthetic { dim: 3000 noise: 0.1 }
    lr { lr: 0.01 }
    steps: 6
    block_elems: 256
    partition_elems: 1024
    optimizer: "onebit_adam" freeze_step: 2
    log_every: 3
    checkpoint { every_steps: 4 }
    timeouts { connect_seconds: 10 step_seconds: 10 rpc_seconds: 2 })",
                                   proto::ConfigFormat::kText);
  EXPECT_TRUE(job.ok()) << job.status();
  return *job;
}

TEST(TrainerTest, RunsOneStepAtATimeLikeTheSimulatorAndReportsEach) {
  const proto::JobSpec job = Job();
  const std::string dir = MakeTempDir("morse-trainer");
  ASSERT_NE(dir, "");
  auto cluster = InProcessCluster::Create(job, {dir});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.checksums = true;
  options.checkpoint_dir = dir;
  options.metrics_path = dir + "/metrics.jsonl";
  options.security.insecure = true;
  std::vector<std::string> lines;
  options.log = [&lines](const std::string& line) { lines.push_back(line); };
  auto trainer = worker::Trainer::Create(job, options, (*cluster)->Connect());
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_EQ((*trainer)->first_step(), 0);

  const testing::Expected expected = testing::Simulate(job);
  for (int64_t step = 0; step < job.steps; ++step) {
    ASSERT_FALSE((*trainer)->done());
    ASSERT_EQ((*trainer)->next_step(), step);
    auto record = (*trainer)->Step();
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(record->step, step);
    EXPECT_EQ(record->phase, step < 2 ? "warmup" : "compression");
    ASSERT_TRUE(record->checksum.has_value());
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum), expected.worker[0][step]) << "step " << step;
    EXPECT_GT(record->traffic.payload_up, 0u);
  }
  EXPECT_TRUE((*trainer)->done());
  auto extra = (*trainer)->Step();
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kFailedPrecondition) << extra.status();

  auto summary = (*trainer)->Summary();
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->steps, job.steps);
  EXPECT_EQ(summary->exchanges, job.steps);
  EXPECT_EQ(absl::StrFormat("%016x", summary->final_checksum), expected.worker[0].back());
  EXPECT_EQ(summary->wire_sent_bytes, 0u) << "no sockets in process: nothing counted";

  // The freeze's line and the progress lines (steps 3 and 6) went to the
  // options' log; a metrics line per step; this worker's checkpoint.
  int progress = 0;
  bool freeze = false;
  for (const std::string& line : lines) {
    freeze = freeze || line.find("v frozen at step 2") != std::string::npos;
    progress += line.find("step ") != std::string::npos && line.find("frozen") == std::string::npos;
  }
  EXPECT_TRUE(freeze) << "no freeze line";
  EXPECT_EQ(progress, 2) << absl::StrCat(lines.size(), " lines");
  std::ifstream metrics(options.metrics_path);
  int metric_lines = 0;
  for (std::string line; std::getline(metrics, line);) ++metric_lines;
  EXPECT_EQ(metric_lines, job.steps);
  EXPECT_TRUE(std::ifstream(dir + "/worker-0.ckpt").good());
}

TEST(TrainerTest, RefusesAnUnknownDeviceBeforeJoining) {
  const proto::JobSpec job = Job();
  auto cluster = InProcessCluster::Create(job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.device = "tpu";
  options.security.insecure = true;
  auto trainer = worker::Trainer::Create(job, options, (*cluster)->Connect());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument) << trainer.status();
  EXPECT_NE(trainer.status().message().find("--device tpu"), std::string::npos) << trainer.status();
}

}  // namespace
}  // namespace morse::inproc
