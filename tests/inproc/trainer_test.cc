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
#include "tests/inproc/faults.h"

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
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum),
              expected.worker[0][step])
        << "step " << step;
    EXPECT_GT(record->traffic.payload_up, 0u);
  }
  EXPECT_TRUE((*trainer)->done());
  auto extra = (*trainer)->Step();
  EXPECT_EQ(extra.status().code(), absl::StatusCode::kFailedPrecondition)
      << extra.status();

  auto summary = (*trainer)->Summary();
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->steps, job.steps);
  EXPECT_EQ(summary->exchanges, job.steps);
  EXPECT_EQ(absl::StrFormat("%016x", summary->final_checksum),
            expected.worker[0].back());
  EXPECT_EQ(summary->wire_sent_bytes, 0u)
      << "no sockets in process: nothing counted";

  // The freeze's line and the progress lines (steps 3 and 6) went to the
  // options' log; a metrics line per step; this worker's checkpoint.
  int progress = 0;
  bool freeze = false;
  for (const std::string& line : lines) {
    freeze = freeze || line.find("v frozen at step 2") != std::string::npos;
    progress += line.find("step ") != std::string::npos &&
                line.find("frozen") == std::string::npos;
  }
  EXPECT_TRUE(freeze) << "no freeze line";
  EXPECT_EQ(progress, 2) << absl::StrCat(lines.size(), " lines");
  std::ifstream metrics(options.metrics_path);
  int metric_lines = 0;
  for (std::string line; std::getline(metrics, line);) ++metric_lines;
  EXPECT_EQ(metric_lines, job.steps);
  EXPECT_TRUE(std::ifstream(dir + "/worker-0.ckpt").good());
}

// A worker starting up polls its shards (GetShardInfo) until every worker
// has joined and rank 0's parameters are in. A poll whose connection is
// lost under it (UNAVAILABLE: a GOAWAY, a shard restarting) is retried
// until the connect timeout, as the first contact is: it had failed the
// job (the test suite saw a rank's wait for the others end "UNAVAILABLE: Too
// many pings").
TEST(TrainerTest, AStatusPollLostUnderItsCallIsRetried) {
  proto::JobSpec job = Job();
  job.checkpoint_every_steps = 0;
  auto cluster = InProcessCluster::Create(job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  FaultPlan plan;
  plan.lose_shard_info_every = 3;
  auto faulty = std::make_unique<FaultyTransport>((*cluster)->Connect(), plan);
  FaultyTransport* faults = faulty.get();
  worker::TrainerOptions options;
  options.checksums = true;
  options.security.insecure = true;
  auto trainer = worker::Trainer::Create(job, options, std::move(faulty));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_GE(faults->injected(), 1u) << "the polls lost no call";
  const testing::Expected expected = testing::Simulate(job);
  for (int64_t step = 0; step < job.steps; ++step) {
    auto record = (*trainer)->Step();
    ASSERT_TRUE(record.ok()) << record.status();
    ASSERT_TRUE(record->checksum.has_value());
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum),
              expected.worker[0][step])
        << "step " << step;
  }
}

// A fresh job's m and v are all zero: FetchPartition flags them and leaves
// their bytes out (two thirds of a new worker's model fetch), and the
// worker that fetched them still equals the simulator. Once they hold
// values they travel in full. RestorePartition refuses a flag that
// contradicts its bytes.
TEST(TrainerTest, FetchLeavesZeroMomentsOutOfTheMessage) {
  const proto::JobSpec job = Job();
  auto cluster = InProcessCluster::Create(job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.checksums = true;
  options.security.insecure = true;
  auto trainer = worker::Trainer::Create(job, options, (*cluster)->Connect());
  ASSERT_TRUE(trainer.ok()) << trainer.status();

  std::unique_ptr<worker::Transport> transport = (*cluster)->Connect();
  worker::CallOptions call;
  call.timeout_seconds = 5;
  v1::ShardInfo info;
  ASSERT_TRUE(worker::Wait(&worker::Transport::GetShardInfo, *transport, 0,
                           v1::ShardInfoRequest(), &info, call)
                  .ok());
  v1::FetchPartitionRequest fetch;
  fetch.set_partition(0);
  fetch.set_layout_fingerprint(info.layout_fingerprint());
  const auto state = [&]() {
    v1::PartitionState reply;
    const absl::Status status = worker::Wait(
        &worker::Transport::FetchPartition, *transport, 0, fetch, &reply, call);
    EXPECT_TRUE(status.ok()) << status;
    return reply;
  };
  const v1::PartitionState fresh = state();
  EXPECT_EQ(fresh.completed_steps(), 0);
  EXPECT_EQ(fresh.x().size(), 4u * 1024);
  EXPECT_TRUE(fresh.m_zero());
  EXPECT_TRUE(fresh.v_zero());
  EXPECT_TRUE(fresh.m().empty());
  EXPECT_TRUE(fresh.v().empty());

  const testing::Expected expected = testing::Simulate(job);
  auto record = (*trainer)->Step();
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(absl::StrFormat("%016x", *record->checksum), expected.worker[0][0]);
  const v1::PartitionState trained = state();
  EXPECT_EQ(trained.completed_steps(), 1);
  EXPECT_FALSE(trained.m_zero());
  EXPECT_FALSE(trained.v_zero());
  EXPECT_EQ(trained.m().size(), 4u * 1024);
  EXPECT_EQ(trained.v().size(), 4u * 1024);

  v1::PartitionState contradicts = trained;
  contradicts.set_rank(0);
  contradicts.set_layout_fingerprint(info.layout_fingerprint());
  contradicts.set_m_zero(true);
  v1::RestorePartitionReply restored;
  const absl::Status refused =
      worker::Wait(&worker::Transport::RestorePartition, *transport, 0,
                   contradicts, &restored, call);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("m_zero is set but m holds 4096 bytes"),
            std::string::npos)
      << refused;
}

// diloco (design.md 2.11) with the built-in workload: each Step() is one
// outer step of 3 inner Adam steps, whose pseudo-gradient goes out in int4
// with error feedback; the worker's outer parameters and momentum are the
// simulator's after every one, and each step reports the inner steps'
// samples. A worker restarted mid-run without its checkpoint (and the inner
// Adam state saved beside it) is refused, saying so.
TEST(TrainerTest, DilocoStepsAreTheSimulatorsAndARejoinIsRefused) {
  auto job = proto::ParseJobConfig(R"(
    workers: 1 shards: 2
    synthetic { dim: 3000 noise: 0.1 }
    lr { lr: 0.01 }
    steps: 5
    block_elems: 256
    partition_elems: 1024
    optimizer: "diloco" diloco { sync_every: 3 outer_lr: 0.8 }
    up_codec { codec: "int4" } worker_feedback { mode: "ef" }
    timeouts { connect_seconds: 10 step_seconds: 10 rpc_seconds: 2 })",
                                   proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  auto cluster = InProcessCluster::Create(*job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.checksums = true;
  options.security.insecure = true;
  options.log = [](const std::string&) {};
  auto trainer = worker::Trainer::Create(*job, options, (*cluster)->Connect());
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const testing::Expected expected = testing::Simulate(*job);
  for (int64_t step = 0; step < 3; ++step) {
    auto record = (*trainer)->Step();
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(record->phase, "outer");
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum),
              expected.worker[0][step])
        << "step " << step;
    EXPECT_GT(record->traffic.payload_up, 0u);
    // The first 2 of the 3 inner steps ran alone; the last shares its time
    // with the exchange and is not in inner_step_seconds.
    EXPECT_GT(record->inner_step_seconds, 0.0);
    EXPECT_LE(2 * record->inner_step_seconds, record->compute_seconds);
  }
  trainer->reset();
  options.rejoin = true;
  auto again = worker::Trainer::Create(*job, options, (*cluster)->Connect());
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("inner Adam state"),
            absl::string_view::npos)
      << again.status();
}

// Streaming DiLoCo (design.md 2.11) with the built-in workload: 2 fragments
// of the 6 partitions, 2 inner Adam steps per outer step, each step syncing
// one fragment while the other keeps the worker's progress; and the
// overlap, where an exchange runs during the next step's first inner step
// and its reply is merged by `mixing` after it, with fragments and without.
// The worker is the simulator's after every step. Killed after step 4 and
// rejoined from its checkpoint of step 4 (with the inner Adam state, its
// own parameters and, with the overlap, the inner steps taken beside it),
// it goes on with the same bits.
class StreamingDilocoTest : public ::testing::TestWithParam<const char*> {};

TEST_P(StreamingDilocoTest, StepsAreTheSimulatorsAcrossARejoin) {
  auto job = proto::ParseJobConfig(absl::StrCat(R"(
    workers: 1 shards: 2
    synthetic { dim: 3000 noise: 0.1 }
    lr { lr: 0.01 }
    steps: 7
    block_elems: 256
    partition_elems: 512
    optimizer: "diloco"
    up_codec { codec: "int4" } worker_feedback { mode: "ef" }
    checkpoint { every_steps: 2 }
    timeouts { connect_seconds: 10 step_seconds: 10 rpc_seconds: 2 })",
                                                GetParam()),
                                   proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string dir = MakeTempDir("morse-streaming");
  ASSERT_NE(dir, "");
  auto cluster = InProcessCluster::Create(*job, {dir});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.checksums = true;
  options.security.insecure = true;
  options.checkpoint_dir = dir;
  options.log = [](const std::string&) {};
  const testing::Expected expected = testing::Simulate(*job);
  auto trainer = worker::Trainer::Create(*job, options, (*cluster)->Connect());
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  for (int64_t step = 0; step < 5; ++step) {
    auto record = (*trainer)->Step();
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum),
              expected.worker[0][step])
        << "step " << step;
  }
  trainer->reset();
  options.rejoin = true;
  auto again = worker::Trainer::Create(*job, options, (*cluster)->Connect());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->first_step(), 4);
  while (!(*again)->done()) {
    auto record = (*again)->Step();
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(absl::StrFormat("%016x", *record->checksum),
              expected.worker[0][record->step])
        << "step " << record->step << " after the rejoin";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Diloco, StreamingDilocoTest,
    ::testing::Values(
        "diloco { sync_every: 4 fragments: 2 outer_lr: 0.8 }",
        "diloco { sync_every: 4 fragments: 2 overlap_steps: 1 outer_lr: 0.8 }",
        "diloco { sync_every: 3 overlap_steps: 2 mixing: 0.25 outer_lr: 0.8 "
        "}"));

TEST(TrainerTest, RefusesAnUnknownDeviceBeforeJoining) {
  const proto::JobSpec job = Job();
  auto cluster = InProcessCluster::Create(job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.device = "tpu";
  options.security.insecure = true;
  auto trainer = worker::Trainer::Create(job, options, (*cluster)->Connect());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument)
      << trainer.status();
  EXPECT_NE(trainer.status().message().find("--device tpu"), std::string::npos)
      << trainer.status();
}

// diloco's synchronous warmup is morse.torch.DiLoCo's for now: morse-worker
// refuses it before joining, saying so.
TEST(TrainerTest, RefusesADilocoWarmupBeforeJoining) {
  auto job = proto::ParseJobConfig(R"(
    workers: 1 shards: 1
    synthetic { dim: 3000 noise: 0.1 }
    lr { lr: 0.01 }
    steps: 5
    optimizer: "diloco" diloco { sync_every: 3 warmup_steps: 2 })",
                                   proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  auto cluster = InProcessCluster::Create(*job, {});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  worker::TrainerOptions options;
  options.security.insecure = true;
  options.log = [](const std::string&) {};
  auto trainer = worker::Trainer::Create(*job, options, (*cluster)->Connect());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kUnimplemented)
      << trainer.status();
  EXPECT_NE(trainer.status().message().find("morse.torch.DiLoCo"),
            std::string::npos)
      << trainer.status();
}

}  // namespace
}  // namespace morse::inproc
