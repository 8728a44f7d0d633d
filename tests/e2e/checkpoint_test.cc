// Recovery (DESIGN 4): a job trains 6 steps with checkpoints and stops; the
// servers restart from their checkpoints and the workers rejoin with
// --rejoin (which starts the first run fresh and resumes the second, as
// --resume would), downloading x, m, v from the shards. Steps 6..11 must be
// bit-identical to a job that never stopped (the simulator), on every
// worker and every server mirror. A corrupt checkpoint stops the server
// with a clear error instead of training from scratch.
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

std::string Config(int steps) {
  return absl::StrCat(R"(
    workers: 2
    shards: 2
    synthetic { dim: 20011 noise: 0.2 }
    optimizer: "onebit_adam"
    lr { lr: 0.01 }
    freeze_step: 3
    block_elems: 256
    partition_elems: 4096
    seed: 5
    checkpoint { every_steps: 3 }
    steps: )",
                      steps);
}

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

// The uninterrupted run of `job`'s 2 workers for `steps` steps: each
// worker's checksum of its x, m, v after every step, [rank][step] (and each
// shard's of its range in `shards`, if given).
std::vector<std::vector<std::string>> Simulated(
    const proto::JobSpec& job, int steps,
    std::vector<std::vector<std::string>>* shards = nullptr) {
  const uint64_t dim = job.algorithm.layout.dim;
  auto sim = *compress::Simulator::Create(job.algorithm,
                                          std::vector<float>(dim, 0.0f));
  std::vector<worker::SyntheticWorkload> workloads = {{job, 0}, {job, 1}};
  std::vector<std::vector<float>> grads(2, std::vector<float>(dim));
  std::vector<std::vector<std::string>> workers(2);
  if (shards != nullptr) shards->assign(2, {});
  for (int64_t step = 0; step < steps; ++step) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(workloads[r]
                      .Gradient(step, sim.worker_x(r), absl::MakeSpan(grads[r]))
                      .ok());
    }
    EXPECT_TRUE(sim.Step({grads[0], grads[1]}).ok());
    for (int r = 0; r < 2; ++r) {
      workers[r].push_back(Hex(compress::StateChecksum(
          {sim.worker_x(r), sim.worker_m(r), sim.v()})));
    }
    for (int s = 0; shards != nullptr && s < 2; ++s) {
      const compress::Range r = sim.layout().shard_range(s);
      (*shards)[s].push_back(
          Hex(compress::StateChecksum({sim.x().subspan(r.begin, r.size()),
                                       sim.m().subspan(r.begin, r.size()),
                                       sim.v().subspan(r.begin, r.size())})));
    }
  }
  return workers;
}

// Runs `cluster` to its end with server and worker checkpoints in `dir`
// (workers --rejoin), then stops its servers; false, with *failure, if a
// worker failed.
bool RunCheckpointed(Cluster& cluster, const std::string& dir, bool state_logs,
                     std::string* failure) {
  cluster.AddServerArgs({"--checkpoint_dir=" + dir});
  cluster.AddWorkerArgs({"--checkpoint_dir=" + dir, "--rejoin"});
  cluster.StartServers(state_logs);
  cluster.StartWorkers(true);
  const bool ok = cluster.WaitWorkers(absl::Seconds(60), failure);
  cluster.StopServers();
  return ok;
}

// Every worker of `cluster` resumed at `step` and then reported the
// expected checksums of the `steps` steps after it.
void ExpectResumedAt(const Cluster& cluster, int64_t step, size_t steps,
                     const std::vector<std::vector<std::string>>& expected) {
  for (int r = 0; r < 2; ++r) {
    const std::string log = ReadFile(cluster.worker_log(r));
    // With the error buffer from its checkpoint of that step (and x, m, v
    // too where the checkpoint holds the whole state, else from the shards).
    const size_t line =
        log.find(absl::StrCat("resuming at step ", step, "; model "));
    ASSERT_NE(line, std::string::npos) << log;
    const std::string resumed = log.substr(line, log.find('\n', line) - line);
    EXPECT_TRUE(resumed.find("error buffer from /") != std::string::npos &&
                resumed.find(absl::StrCat("/worker-", r, ".ckpt")) !=
                    std::string::npos)
        << log;
    const auto got = JsonField(ReadFile(cluster.worker_metrics(r)), "checksum");
    ASSERT_EQ(got.size(), steps) << log;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], expected[r][step + i])
          << "worker " << r << " step " << step + i;
    }
  }
}

// Runs config(6), checkpointing into a fresh directory (the shards' last
// checkpoint must be of step `written`), then config(12) from those
// checkpoints: every worker resumes at `resumed` and reports the
// uninterrupted run's checksums from there to the end.
void ExpectStopAndResumeBitForBit(const std::function<std::string(int)>& config,
                                  int written, int64_t resumed) {
  const auto expected = Simulated(
      *proto::ParseJobConfig(config(12), proto::ConfigFormat::kText), 12);
  char pattern[] = "/tmp/morse-ckpt-XXXXXX";
  const std::string ckpt = mkdtemp(pattern);
  std::string failure;
  {
    Cluster first(config(6), 2, 2);
    ASSERT_TRUE(RunCheckpointed(first, ckpt, false, &failure)) << failure;
    EXPECT_NE(
        ReadFile(first.server_log(0))
            .find(absl::StrCat("checkpoint of step ", written, " written")),
        std::string::npos)
        << ReadFile(first.server_log(0));
  }
  Cluster second(config(12), 2, 2);
  ASSERT_TRUE(RunCheckpointed(second, ckpt, true, &failure)) << failure;
  ExpectResumedAt(second, resumed, static_cast<size_t>(12 - resumed), expected);
  std::system(absl::StrCat("rm -rf ", ckpt).c_str());
}

TEST(CheckpointTest, RestartedServersAndResumedWorkersContinueBitForBit) {
  auto job = *proto::ParseJobConfig(Config(12), proto::ConfigFormat::kText);
  std::vector<std::vector<std::string>> shards;
  const auto expected = Simulated(job, 12, &shards);  // the uninterrupted run

  char pattern[] = "/tmp/morse-ckpt-XXXXXX";
  const std::string ckpt = mkdtemp(pattern);
  std::string failure;
  {
    Cluster first(Config(6), 2, 2);
    ASSERT_TRUE(RunCheckpointed(first, ckpt, false, &failure)) << failure;
    for (int r = 0; r < 2; ++r) {
      const auto got = JsonField(ReadFile(first.worker_metrics(r)), "checksum");
      ASSERT_EQ(got.size(), 6u);
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(got[i], expected[r][i]) << "worker " << r << " step " << i;
    }
    EXPECT_NE(
        ReadFile(first.server_log(0)).find("checkpoint of step 6 written"),
        std::string::npos)
        << ReadFile(first.server_log(0));
  }
  Cluster second(Config(12), 2, 2);
  ASSERT_TRUE(RunCheckpointed(second, ckpt, true, &failure)) << failure;
  EXPECT_NE(ReadFile(second.server_log(0)).find("resumed from"),
            std::string::npos);
  ExpectResumedAt(second, 6, 6, expected);
  for (int s = 0; s < 2; ++s) {
    const auto got =
        JsonField(ReadFile(second.state_log(s)), "mirror_checksum");
    ASSERT_EQ(got.size(), 6u);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], shards[s][6 + i]) << "shard " << s << " step " << 6 + i;
    }
  }
  std::system(absl::StrCat("rm -rf ", ckpt).c_str());
}

// zero_one_adam (docs/design.md 2.7): a job stopped in the middle of a
// local interval. The shards hold the last sync (step 3 done: completed 4),
// the workers' checkpoints are labelled with that step and hold their whole
// state at step 6 (the interval's start, the update so far), and the
// resumed workers go on from step 6, bit for bit.
TEST(CheckpointTest, ZeroOneAdamResumesInsideALocalIntervalBitForBit) {
  const auto config = [](int steps) {
    return absl::StrCat(R"(
      workers: 2
      shards: 2
      synthetic { dim: 20011 noise: 0.2 }
      optimizer: "zero_one_adam"
      zero_one_adam { var_freeze_step: 2 var_update_scaler: 1 local_step_scaler: 1 local_step_clipper: 4 }
      lr { lr: 0.01 }
      block_elems: 256
      partition_elems: 4096
      seed: 5
      checkpoint { every_steps: 3 }
      steps: )",
                        steps);
  };
  // Variance steps 0, 1; syncs 2, 3, 7, 11; local steps 4-6 and 8-10.
  ExpectStopAndResumeBitForBit(config, 4, 6);
}

// onebit_lamb's shards checkpoint its fresh variance and the layers' state
// (coeff_freeze, last_factor); resumed workers fetch them with the model.
// Stopped after the freeze, the job continues bit for bit.
TEST(CheckpointTest, OneBitLambResumesWithItsLayerStateBitForBit) {
  const auto config = [](int steps) {
    return absl::StrCat(R"(
      workers: 2
      shards: 2
      synthetic { dim: 20011 noise: 0.2 layer_elems: 3000 }
      optimizer: "onebit_lamb"
      freeze_step: 3
      adam { weight_decay: 0.01 }
      lr { lr: 0.01 }
      block_elems: 256
      partition_elems: 4096
      seed: 5
      checkpoint { every_steps: 3 }
      steps: )",
                        steps);
  };
  ExpectStopAndResumeBitForBit(config, 6, 6);
}

// A worker checkpoint older than any reply the shards keep (the worker died
// after the shards' last checkpoint but before its own; shards restored
// from a checkpoint keep only its step's replies): the worker cannot replay,
// so it rejoins at the shards' step with x, m, v from them and its error
// buffer from zero, says so, and the job goes on.
TEST(CheckpointTest, AWorkerCheckpointTooOldToReplayRejoinsAtTheShardsStep) {
  char older_pattern[] = "/tmp/morse-ckpt-XXXXXX",
       pattern[] = "/tmp/morse-ckpt-XXXXXX";
  const std::string older = mkdtemp(older_pattern), ckpt = mkdtemp(pattern);
  std::string failure;
  {
    Cluster first(Config(3), 2, 2);  // worker checkpoints of step 3
    ASSERT_TRUE(RunCheckpointed(first, older, false, &failure)) << failure;
  }
  {
    Cluster second(Config(6), 2, 2);  // everything at step 6
    ASSERT_TRUE(RunCheckpointed(second, ckpt, false, &failure)) << failure;
  }
  ASSERT_EQ(std::system(absl::StrCat("cp ", older, "/worker-1.ckpt ", ckpt,
                                     "/worker-1.ckpt")
                            .c_str()),
            0);
  Cluster third(Config(9), 2, 2);
  ASSERT_TRUE(RunCheckpointed(third, ckpt, false, &failure)) << failure;
  const std::string log = ReadFile(third.worker_log(1));
  EXPECT_NE(log.find("resuming at step 6; model from the shards, error buffer "
                     "from zero ("),
            std::string::npos)
      << log;
  EXPECT_NE(
      log.find(
          "is of step 3, and the shards keep no replies to replay from there"),
      std::string::npos)
      << log;
  EXPECT_NE(ReadFile(third.worker_log(0))
                .find("resuming at step 6; model and error buffer from "),
            std::string::npos);
  std::system(absl::StrCat("rm -rf ", older, " ", ckpt).c_str());
}

TEST(CheckpointTest, ACorruptCheckpointStopsTheServerWithAClearError) {
  char pattern[] = "/tmp/morse-ckpt-XXXXXX";
  const std::string ckpt = mkdtemp(pattern);
  {
    Cluster run(Config(3), 2, 2);
    run.AddServerArgs({"--checkpoint_dir=" + ckpt});
    run.StartServers(false);
    run.StartWorkers(false);
    std::string failure;
    ASSERT_TRUE(run.WaitWorkers(absl::Seconds(60), &failure)) << failure;
  }
  const std::string path = ckpt + "/shard-0.ckpt";
  std::string bytes = ReadFile(path);
  ASSERT_GT(bytes.size(), 1000u);
  bytes[bytes.size() / 2] ^= 0x10;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  Cluster again(Config(6), 1, 0);
  testing::Process server(
      {testing::ServerBin(), "--config", again.config_path(), "--shard", "0",
       "--listen", "127.0.0.1:0", "--insecure", "--checkpoint_dir=" + ckpt},
      again.dir() + "/corrupt.log");
  int code = -1;
  ASSERT_TRUE(server.Wait(absl::Seconds(20), &code));
  EXPECT_EQ(code, 2);
  const std::string log = ReadFile(again.dir() + "/corrupt.log");
  EXPECT_NE(log.find("is corrupt: checksum mismatch"), std::string::npos)
      << log;
  std::system(absl::StrCat("rm -rf ", ckpt).c_str());
}

}  // namespace
}  // namespace morse
