// N workers and S shards in one process (InProcessCluster), each worker a
// Trainer (morse-worker's step loop) on its own thread over a
// FaultyTransport, swept over faults × N × S × optimizers and codecs:
// whatever the network does (refused pushes, lost replies, duplicates,
// drops, reordering), when a shard dies and comes back from its checkpoint
// mid-run, and when a worker dies and rejoins from its own, every worker's
// x, m, v after every step and every shard's mirror at the end are
// bit-identical to the simulator's.

#include <atomic>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/replica.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/e2e/expected.h"
#include "tests/inproc/cluster.h"
#include "tests/inproc/faults.h"
#include "tests/inproc/schemes.h"
#include "worker/trainer.h"

namespace morse::inproc {
namespace {

enum class Faults {
  kNone,
  kLossy,
  kDuplicatesAndReordering,
  kDrops,
  kShardKilled,
  kWorkerKilled
};

const char* Name(Faults f) {
  switch (f) {
    case Faults::kNone:
      return "none";
    case Faults::kLossy:
      return "lossy";
    case Faults::kDuplicatesAndReordering:
      return "duplicates_reordering";
    case Faults::kDrops:
      return "drops";
    case Faults::kShardKilled:
      return "shard_killed";
    case Faults::kWorkerKilled:
      return "worker_killed";
  }
  return "?";
}

FaultPlan PlanFor(Faults f, uint32_t rank) {
  FaultPlan plan;
  plan.seed = 1000 + rank;
  switch (f) {
    case Faults::kLossy:
      plan.refuse = 0.1;
      plan.lose_reply = 0.1;
      break;
    case Faults::kDuplicatesAndReordering:
      plan.duplicate = 0.2;
      plan.max_delay = absl::Milliseconds(4);
      break;
    case Faults::kDrops:
      plan.drop = 0.03;
      break;
    case Faults::kNone:
    case Faults::kShardKilled:
    case Faults::kWorkerKilled:
      break;
  }
  return plan;
}

// kWorkerKilled: the worker killed before step 5 and the one killed before
// step 9, ranks 0 and 1 (the only one with one worker); -1: none. Each has
// checkpointed the step before last (every 2 steps), so it replays one step
// from the shards' kept replies when it rejoins.
int WorkerVictim(int64_t step, uint32_t workers) {
  if (step == 5) return 0;
  if (step == 9) return workers > 1 ? 1 : 0;
  return -1;
}

using Param =
    std::tuple<Faults, uint32_t /*workers*/, uint32_t /*shards*/, Scheme>;

class FaultSweepTest : public ::testing::TestWithParam<Param> {};

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

TEST_P(FaultSweepTest, EveryWorkerAndShardMatchesTheSimulator) {
  const auto [faults, workers, shards, scheme] = GetParam();
  const std::string config =
      absl::StrCat(R"(
    synthetic { dim: 5003 noise: 0.2 }
    lr { lr: 0.01 }
    steps: 14
    block_elems: 256
    partition_elems: 1024
    seed: 11
    window: 3
    timeouts { connect_seconds: 20 step_seconds: 30 rpc_seconds: 1 recovery_seconds: 60 }
    checkpoint { every_steps: 2 }
    workers: )",
                   workers, " shards: ", shards, " ", scheme.config);
  auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const testing::Expected expected = testing::Simulate(*job);
  const std::string dir = MakeTempDir("morse-inproc");
  ASSERT_NE(dir, "");
  auto cluster = InProcessCluster::Create(
      *job, {dir, /*compute_threads=*/1, /*delivery_threads=*/2});
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  std::vector<std::string> failures(workers);
  std::vector<std::vector<std::string>> sums(workers);
  std::vector<uint64_t> injected(workers, 0);
  std::vector<std::thread> threads;
  std::atomic<uint32_t> running{workers};
  std::atomic<bool> failed{false};
  // The kills happen once a shard has completed kill_at[k] steps; workers
  // wait before step kill_at[k] + 2 until that kill is done, so that no run
  // ends before both.
  constexpr int64_t kill_at[] = {4, 9};
  std::atomic<int> kills{0};
  for (uint32_t r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      struct Exit {
        std::atomic<uint32_t>* running;
        ~Exit() { --*running; }
      } exit{&running};
      const auto fail = [&](std::string what) {
        failures[r] = std::move(what);
        failed = true;
      };
      // Each worker is a Trainer, morse-worker's step loop; a killed one is
      // destroyed between steps and a new one rejoins (--rejoin) from its
      // checkpoint, as after kill -9 and a supervisor's restart.
      worker::TrainerOptions options;
      options.rank = r;
      options.checksums = true;
      options.checkpoint_dir = dir;
      options.compute_threads = 1;
      options.security.insecure = true;
      options.rejoin = true;
      options.log = [](const std::string&) {};
      FaultyTransport* faulty = nullptr;
      const auto create =
          [&]() -> absl::StatusOr<std::unique_ptr<worker::Trainer>> {
        auto transport = std::make_unique<FaultyTransport>(
            (*cluster)->Connect(), PlanFor(faults, r));
        faulty = transport.get();
        return worker::Trainer::Create(*job, options, std::move(transport));
      };
      int64_t killed_before = -1;  // the last kill's step
      auto trainer = create();
      if (!trainer.ok())
        return fail(absl::StrCat("start: ", trainer.status().ToString()));
      while (!(*trainer)->done()) {
        const int64_t step = (*trainer)->next_step();
        if (faults == Faults::kShardKilled) {
          int due = 0;
          for (int64_t at : kill_at) due += step >= at + 2 ? 1 : 0;
          while (kills.load() < due && !failed.load())
            absl::SleepFor(absl::Milliseconds(1));
        }
        if (faults == Faults::kWorkerKilled &&
            static_cast<int>(r) == WorkerVictim(step, workers) &&
            step > killed_before) {
          killed_before = step;
          injected[r] += faulty->injected();
          trainer->reset();  // its memory is gone; its checkpoint stays
          ++kills;
          absl::SleepFor(absl::Milliseconds(20));
          trainer = create();
          if (!trainer.ok())
            return fail(absl::StrCat("rejoin before step ", step, ": ",
                                     trainer.status().ToString()));
          // From its checkpoint of two steps before: it runs step - 1 again,
          // the shards answering with the reply they kept, and its state
          // after it is checked against the simulator's again.
          if ((*trainer)->first_step() != step - 1) {
            return fail(absl::StrCat("rejoined at step ",
                                     (*trainer)->first_step(), ", not ",
                                     step - 1));
          }
          sums[r].resize(step - 1);
          continue;
        }
        auto record = (*trainer)->Step();
        if (!record.ok())
          return fail(
              absl::StrCat("step ", step, ": ", record.status().ToString()));
        sums[r].push_back(Hex(*record->checksum));
      }
      injected[r] += faulty->injected();
    });
  }
  if (faults == Faults::kShardKilled) {
    // Kills a shard mid-step once it has checkpointed, and its supervisor
    // brings it back a moment later, twice in the run (while the workers
    // still run).
    std::mt19937 random(workers * 10 + shards);
    for (int64_t at : kill_at) {
      const uint32_t victim = random() % shards;
      bool reached = false;
      while (!reached && running.load() > 0 && !failed.load()) {
        auto done = (*cluster)->CompletedSteps(victim);
        reached = done.ok() && *done >= at;
        if (!reached) absl::SleepFor(absl::Milliseconds(1));
      }
      if (!reached) break;
      absl::SleepFor(absl::Microseconds(random() % 3000));
      (*cluster)->Kill(victim);
      ++kills;
      absl::SleepFor(absl::Milliseconds(30));
      EXPECT_TRUE((*cluster)->Restart(victim).ok());
    }
  }
  for (std::thread& t : threads) t.join();
  const auto shard_log = [&] {
    std::string all;
    for (const std::string& line : (*cluster)->log())
      absl::StrAppend(&all, line, "\n");
    return all;
  };
  for (uint32_t r = 0; r < workers; ++r) {
    ASSERT_EQ(failures[r], "") << "worker " << r << "; the shards said:\n"
                               << shard_log();
    ASSERT_EQ(sums[r].size(), expected.worker[r].size()) << "worker " << r;
    for (size_t t = 0; t < sums[r].size(); ++t) {
      ASSERT_EQ(sums[r][t], expected.worker[r][t])
          << "worker " << r << " differs at step " << t;
    }
  }
  for (uint32_t s = 0; s < shards; ++s) {
    auto mirror = (*cluster)->MirrorChecksum(s);
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    EXPECT_EQ(Hex(*mirror), expected.shard[s].back()) << "shard " << s;
  }
  uint64_t total = 0;
  for (uint64_t n : injected) total += n;
  if (faults != Faults::kNone && faults != Faults::kShardKilled &&
      faults != Faults::kWorkerKilled) {
    EXPECT_GT(total, 0u)
        << "the plan injected nothing: the test would prove nothing";
  }
  if (faults == Faults::kShardKilled || faults == Faults::kWorkerKilled) {
    EXPECT_EQ(kills.load(), 2)
        << "the run ended before both kills: the test would prove little";
    total = kills;
  }
  std::printf(
      "%s, %u workers, %u shards, %s: %zu steps bit-identical to the "
      "simulator; %llu faults "
      "injected\n",
      Name(faults), workers, shards, scheme.name, expected.model.size(),
      static_cast<unsigned long long>(total));
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat(
      Name(std::get<0>(info.param)), "_", std::get<1>(info.param), "workers_",
      std::get<2>(info.param), "shards_", std::get<3>(info.param).name);
}

// Every fault each suite below is swept over.
constexpr Faults kEveryFault[] = {
    Faults::kNone,  Faults::kLossy,       Faults::kDuplicatesAndReordering,
    Faults::kDrops, Faults::kShardKilled, Faults::kWorkerKilled};
INSTANTIATE_TEST_SUITE_P(Sweep, FaultSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kEveryFault),
                                            ::testing::Values(1u, 3u),
                                            ::testing::Values(1u, 2u),
                                            ::testing::ValuesIn(kSchemes)),
                         ParamName);

// diloco: 4 inner Adam steps per outer step, the pseudo-gradient in int8
// with error feedback both ways. A killed worker rejoins from its
// checkpoint and the inner Adam state saved beside it (without that state
// it is refused: TrainerTest.DilocoStepsAreTheSimulatorsAndARejoinIsRefused).
constexpr Scheme kDiloco[] = {
    {"diloco_int8", R"(optimizer: "diloco" diloco { sync_every: 4 }
       up_codec { codec: "int8" } worker_feedback { mode: "ef" })"},
};
INSTANTIATE_TEST_SUITE_P(Diloco, FaultSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kEveryFault),
                                            ::testing::Values(1u, 3u),
                                            ::testing::Values(1u, 2u),
                                            ::testing::ValuesIn(kDiloco)),
                         ParamName);

// Streaming DiLoCo (design.md 2.11): 3 fragments of the 6 partitions two
// shards give this layout, one synced per step, 2 inner Adam steps apart;
// a rejoining worker also restores its own values of the fragments not
// synced (inner_x).
constexpr Scheme kStreaming[] = {
    {"diloco_streaming", R"(optimizer: "diloco"
       diloco { sync_every: 6 fragments: 3 }
       up_codec { codec: "int8" } worker_feedback { mode: "ef" })"},
};
INSTANTIATE_TEST_SUITE_P(Streaming, FaultSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kEveryFault),
                                            ::testing::Values(1u, 3u),
                                            ::testing::Values(2u),
                                            ::testing::ValuesIn(kStreaming)),
                         ParamName);

// The overlap (design.md 2.11): each exchange runs during the next step's
// first inner step, its reply mixed in after it; a rejoining worker also
// restores whether that step was taken (inner_taken).
constexpr Scheme kOverlap[] = {
    {"diloco_overlap", R"(optimizer: "diloco"
       diloco { sync_every: 6 fragments: 3 overlap_steps: 1 mixing: 0.25 }
       up_codec { codec: "int8" } worker_feedback { mode: "ef" })"},
};
INSTANTIATE_TEST_SUITE_P(Overlap, FaultSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kEveryFault),
                                            ::testing::Values(3u),
                                            ::testing::Values(2u),
                                            ::testing::ValuesIn(kOverlap)),
                         ParamName);

}  // namespace
}  // namespace morse::inproc
