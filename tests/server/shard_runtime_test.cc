// ShardRuntime without a process: periodic and shutdown checkpoints and
// resuming from them, the state log, progress and stall lines, and steps
// failed past the recovery timeout (what morse-server's main() wires).
#include "server/shard_runtime.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "compress/bytes_hash.h"
#include "compress/sync.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_file.h"
#include "proto/job_config.h"
#include "tests/compress/test_util.h"

namespace morse::server {
namespace {

constexpr char kConfig[] = R"(
  workers: 2
  shards: 1
  synthetic { dim: 96 }
  lr { lr: 0.01 }
  steps: 10
  freeze_step: 2
  block_elems: 16
  partition_elems: 32
  log_every: 2
  checkpoint { every_steps: 2 }
  timeouts { step_seconds: 1 recovery_seconds: 3 }
)";

class ShardRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = *proto::ParseJobConfig(kConfig, proto::ConfigFormat::kText);
    dir_ = ::testing::TempDir() + "/shard_runtime_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }

  std::unique_ptr<ShardRuntime> MakeRuntime(std::ostream* state_log = nullptr) {
    return std::make_unique<ShardRuntime>(ShardRuntime::Options{
        0, dir_ + "/shard-0.ckpt", state_log, [this](const std::string& line) {
          MutexLock lock(&mu_);
          lines_.push_back(line);
        }});
  }
  std::unique_ptr<ShardCore> MakeCore(ShardRuntime& runtime, bool init = true) {
    auto core = *ShardCore::Create(job_, 0);
    EXPECT_TRUE(runtime.OnConfigured(job_, *core).ok());
    if (init) {
      for (const auto& p : core->layout().shard_partitions(0)) {
        const std::vector<float> x0 =
            compress::testing::VariedData(p.range.size(), p.id);
        EXPECT_TRUE(
            core->InitPartition(
                    0, p.id, core->layout().fingerprint(),
                    {reinterpret_cast<const char*>(x0.data()), 4 * x0.size()})
                .ok());
      }
    }
    return core;
  }
  // Both workers push every partition of `step`.
  void Step(ShardCore& core, int64_t step) {
    for (const auto& p : core.layout().shard_partitions(0)) {
      for (uint32_t rank = 0; rank < 2; ++rank)
        core.Push(Args(core, step, rank, p), [](auto) {});
    }
  }
  PushArgs Args(const ShardCore& core, int64_t step, uint32_t rank,
                const compress::Partition& p) {
    const compress::StepPlan plan = compress::PlanStep(job_.algorithm, step);
    const std::vector<float> g =
        compress::testing::VariedData(p.range.size(), 10 * step + rank);
    PushArgs args{step,         rank, p.id,        core.layout().fingerprint(),
                  plan.up.kind, {},   std::nullopt};
    args.payload.resize(compress::PayloadBytes(plan.up, g.size()));
    EXPECT_TRUE(
        compress::Encode(plan.up, g, {},
                         {reinterpret_cast<uint8_t*>(args.payload.data()),
                          args.payload.size()})
            .ok());
    return args;
  }
  bool Logged(const std::string& words) {
    MutexLock lock(&mu_);
    for (const std::string& l : lines_) {
      if (l.find(words) != std::string::npos) return true;
    }
    return false;
  }

  proto::JobSpec job_;
  std::string dir_;
  Mutex mu_;
  std::vector<std::string> lines_;
};

TEST_F(ShardRuntimeTest, CheckpointsEveryKStepsAndAtShutdownAndResumes) {
  std::ostringstream state_log;
  auto runtime = MakeRuntime(&state_log);
  auto core = MakeCore(*runtime);
  for (int64_t step = 0; step < 3; ++step) Step(*core, step);
  runtime->FlushCheckpoints();
  auto periodic = proto::CheckpointReader::Open(dir_ + "/shard-0.ckpt");
  ASSERT_TRUE(periodic.ok()) << periodic.status();
  EXPECT_EQ(periodic->header().step,
            2);  // written after step 1 (every 2 steps)
  EXPECT_TRUE(Logged("checkpoint of step 2 written")) << lines_.size();
  EXPECT_TRUE(Logged("step 1 completed"));  // log_every 2
  EXPECT_FALSE(Logged("step 2 completed"));
  // One state-log line per step, with the mirror checksum.
  std::istringstream lines(state_log.str());
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    EXPECT_NE(line.find("\"step\":" + std::to_string(count)), std::string::npos)
        << line;
    EXPECT_NE(line.find("mirror_checksum"), std::string::npos);
  }
  EXPECT_EQ(count, 3);
  const uint64_t before = core->MirrorChecksum();
  runtime->Shutdown(core.get());
  EXPECT_TRUE(Logged("stopped after 3 steps; 18 pushes accepted, 0 rejected"));
  EXPECT_EQ(
      proto::CheckpointReader::Open(dir_ + "/shard-0.ckpt")->header().step, 3);

  // A new process: the shard resumes from the shutdown checkpoint.
  lines_.clear();
  auto again = MakeRuntime();
  auto resumed = MakeCore(*again, /*init=*/false);
  EXPECT_TRUE(Logged("resumed from " + dir_ + "/shard-0.ckpt at step 3"));
  EXPECT_EQ(resumed->Status().completed_steps, 3);
  EXPECT_EQ(resumed->MirrorChecksum(), before);
}

// Weights changed after a step (ShardCore::ReplaceX, design.md 4): once
// every partition holds its new x, the checkpoint is on disk, before rank 0
// hears back, so a restart never replays the steps before without it; and
// a shard restarted from it still requires the next pushes to show x.
TEST_F(ShardRuntimeTest, WeightsChangedAfterAStepAreCheckpointedAtOnce) {
  auto runtime = MakeRuntime();
  auto core = MakeCore(*runtime);
  Step(*core, 0);  // every_steps 2: no periodic checkpoint yet
  runtime->FlushCheckpoints();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/shard-0.ckpt"));
  const auto& partitions = core->layout().shard_partitions(0);
  for (const auto& p : partitions) {
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/shard-0.ckpt"));
    const std::vector<float> x(p.range.size(), 0.25f * (p.id + 1));
    ASSERT_TRUE(
        core->ReplaceX(0, p.id, core->layout().fingerprint(), 1, x).ok());
  }
  EXPECT_TRUE(Logged("checkpoint of step 1 written")) << lines_.size();
  EXPECT_TRUE(Logged("weights changed before step 1"));
  const uint64_t changed = core->MirrorChecksum();
  auto again = MakeRuntime();
  auto resumed = MakeCore(*again, /*init=*/false);
  EXPECT_EQ(resumed->Status().completed_steps, 1);
  EXPECT_EQ(resumed->MirrorChecksum(), changed);
  const auto fetched =
      resumed->FetchPartition(partitions[0].id, core->layout().fingerprint());
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->x, std::vector<float>(partitions[0].range.size(),
                                           0.25f * (partitions[0].id + 1)));
  // The restarted shard still checks that step 1's pushes show the change:
  // without x's hash refused, with it taken.
  absl::Status unchanged = absl::UnknownError("pending");
  resumed->Push(Args(*resumed, 1, 0, partitions[0]),
                [&](auto r) { unchanged = r.status(); });
  EXPECT_EQ(unchanged.code(), absl::StatusCode::kFailedPrecondition)
      << unchanged;
  EXPECT_NE(unchanged.message().find("after step 0 and rank 0 did not"),
            std::string::npos)
      << unchanged;
  PushArgs shown = Args(*resumed, 1, 0, partitions[0]);
  shown.x_hash = compress::XHash(fetched->x);
  absl::Status taken = absl::UnknownError("pending");
  resumed->Push(std::move(shown), [&](auto r) { taken = r.status(); });
  EXPECT_EQ(taken.code(), absl::StatusCode::kUnknown)
      << taken;  // waits for rank 1
}

TEST_F(ShardRuntimeTest, ACorruptCheckpointStopsTheShardSayingWhatToDo) {
  { std::ofstream(dir_ + "/shard-0.ckpt") << "not a checkpoint"; }
  auto runtime = MakeRuntime();
  auto core = *ShardCore::Create(job_, 0);
  const absl::Status s = runtime->OnConfigured(job_, *core);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("move the file away"), absl::string_view::npos)
      << s;
}

TEST_F(ShardRuntimeTest, StalledStepsAreReportedThenExpired) {
  auto runtime = MakeRuntime();
  auto core = MakeCore(*runtime);
  const compress::Partition& first = core->layout().shard_partitions(0)[0];
  absl::Status waiting = absl::UnknownError("pending");
  core->Push(Args(*core, 0, 0, first), [&](auto r) { waiting = r.status(); });
  const absl::Time now = absl::Now();
  runtime->Tick(*core, now);
  EXPECT_FALSE(Logged("rank(s) 1"));
  runtime->Tick(*core, now + absl::Seconds(2));  // past step_seconds: reported
  EXPECT_TRUE(Logged("for rank(s) 1"));
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnknown);  // still waiting
  runtime->Tick(*core,
                now + absl::Seconds(4));  // past recovery_seconds: failed
  EXPECT_EQ(waiting.code(), absl::StatusCode::kDeadlineExceeded) << waiting;
  // The expired step left nothing behind: the shutdown checkpoint is step 0's.
  runtime->Shutdown(core.get());
  EXPECT_TRUE(Logged("checkpoint of step 0 written"));
  EXPECT_TRUE(Logged("stopped after 0 steps; 1 pushes accepted"));
}

TEST_F(ShardRuntimeTest, NoWorkerEverJoined) {
  auto runtime = MakeRuntime();
  runtime->Shutdown(nullptr);
  EXPECT_TRUE(Logged("stopped before any worker joined"));
}

}  // namespace
}  // namespace morse::server
