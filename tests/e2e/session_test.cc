// A worker session against a real server: a step that fails (here: the
// other rank never pushes, so the shard times the step out) ends training,
// and a retried step is refused rather than applying replies twice.
#include "worker/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "compress/layout.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "proto/wire.h"
#include "tests/compress/test_util.h"
#include "tests/e2e/cluster.h"
#include "worker/transport/grpc/transport.h"

namespace morse {
namespace {

// A job of two ranks on two real shards, both sessions started.
class TwoRanks {
 public:
  TwoRanks(const std::string& config, const proto::JobSpec& job)
      : job_(job), cluster_(config, 2, 0) {}

  void Start() {
    cluster_.StartServers(false);
    const std::vector<std::string> servers = {cluster_.server_address(0),
                                              cluster_.server_address(1)};
    for (uint32_t r = 0; r < 2; ++r) {
      auto session =
          worker::Session::Connect(job_, r, servers, proto::Insecure());
      ASSERT_TRUE(session.ok()) << session.status();
      ranks.push_back(*std::move(session));
    }
    auto started = Both(
        [](worker::Session& s, uint32_t) { return s.Start(false).status(); });
    ASSERT_TRUE(started.first.ok()) << started.first;
    ASSERT_TRUE(started.second.ok()) << started.second;
  }

  // Step `step` on both ranks with gradients drawn from the step and the
  // rank, and on `sim`: both ranks' x must be the simulator's after it.
  void StepLikeTheSimulator(compress::Simulator& sim, int64_t step) {
    std::vector<std::vector<float>> grads;
    for (uint32_t r = 0; r < 2; ++r)
      grads.push_back(compress::testing::VariedData(1000, 10 * step + r));
    auto stepped =
        Both([&](worker::Session& s, uint32_t r) { return s.Step(grads[r]); });
    ASSERT_TRUE(stepped.first.ok()) << stepped.first;
    ASSERT_TRUE(stepped.second.ok()) << stepped.second;
    const std::vector<absl::Span<const float>> spans = {grads[0], grads[1]};
    ASSERT_TRUE(sim.Step(spans).ok());
    for (uint32_t r = 0; r < 2; ++r) {
      const auto x = ranks[r]->replica().x();
      ASSERT_TRUE(std::equal(x.begin(), x.end(), sim.worker_x(r).begin()))
          << "rank " << r << " after step " << step;
    }
  }

  // f(session, rank) on both ranks at once (each may wait for the other),
  // and their outcomes.
  template <typename F>
  std::pair<absl::Status, absl::Status> Both(F&& f) {
    absl::Status status[2];
    std::thread other([&] { status[1] = f(*ranks[1], 1); });
    status[0] = f(*ranks[0], 0);
    other.join();
    return {status[0], status[1]};
  }

  std::vector<std::unique_ptr<worker::Session>> ranks;
  testing::Cluster& cluster() { return cluster_; }

 private:
  proto::JobSpec job_;
  testing::Cluster cluster_;
};

TEST(SessionTest, AFailedStepIsNotRetried) {
  const std::string config = R"(
    workers: 2
    shards: 1
    synthetic { dim: 1000 }
    lr { lr: 0.01 }
    steps: 10
    freeze_step: 2
    block_elems: 16
    partition_elems: 256
    timeouts { step_seconds: 1 recovery_seconds: 2 connect_seconds: 10 }
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  testing::Cluster cluster(config, 1, 0);
  cluster.StartServers(false);
  auto session = worker::Session::Connect(job, 0, {cluster.server_address(0)},
                                          proto::Insecure());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->Start(false).ok());
  std::vector<float> grad(1000, 0.5f);
  const absl::Status first = (*session)->Step(grad);
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_NE(first.message().find("rank(s) 1 did not push"),
            absl::string_view::npos)
      << first;
  const absl::Status again = (*session)->Step(grad);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("--resume"), absl::string_view::npos) << again;
  EXPECT_EQ((*session)->step(), 0);
}

// Rank 0 restores a saved run (load_state_dict against fresh shards)
// partition by partition; a rank that starts meanwhile finds partitions at
// different steps. It waits for them to agree, as Restore waits for the
// shards, instead of failing its start (python_resume saw that once).
TEST(SessionTest, ARankStartingWhileRankZeroRestoresWaitsForIt) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 1000 }
    lr { lr: 0.01 }
    steps: 10
    freeze_step: 2
    block_elems: 16
    partition_elems: 256
    timeouts { connect_seconds: 20 }
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  testing::Cluster cluster(config, 2, 0);
  cluster.StartServers(false);
  const std::vector<std::string> servers = {cluster.server_address(0),
                                            cluster.server_address(1)};
  auto rank0 = worker::Session::Connect(job, 0, servers, proto::Insecure());
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE((*rank0)->Start(false).ok());

  // Rank 0's restore, one partition at a time: step 3, x = 0.25.
  const compress::Layout layout =
      *compress::Layout::Create(job.algorithm.layout);
  auto transport =
      *worker::GrpcTransport::Create(job, servers, 0, proto::Insecure());
  const auto restore = [&](const compress::Partition& p) {
    const std::string quarter(4 * p.range.size(), '\0');
    std::vector<float> x(p.range.size(), 0.25f);
    v1::PartitionState request;
    request.set_rank(0);
    request.set_partition(p.id);
    request.set_layout_fingerprint(layout.fingerprint());
    request.set_completed_steps(3);
    request.set_x(
        std::string(reinterpret_cast<const char*>(x.data()), 4 * x.size()));
    request.set_m(quarter);
    request.set_v(quarter);
    request.set_server_error(quarter);
    v1::RestorePartitionReply reply;
    absl::Notification done;
    absl::Status status;
    transport->RestorePartition(p.shard, request, &reply, {},
                                [&](absl::Status s) {
                                  status = s;
                                  done.Notify();
                                });
    done.WaitForNotification();
    return status;
  };
  const auto& partitions = layout.partitions();
  ASSERT_GT(partitions.size(), 2u);
  ASSERT_TRUE(restore(partitions[0]).ok());

  absl::StatusOr<int64_t> started = absl::UnknownError("not started");
  std::unique_ptr<worker::Session> rank1;
  std::thread starter([&] {
    auto session = worker::Session::Connect(job, 1, servers, proto::Insecure());
    if (!session.ok()) {
      started = session.status();
      return;
    }
    rank1 = *std::move(session);
    started = rank1->Start(false);
  });
  absl::SleepFor(absl::Milliseconds(500));
  for (size_t i = 1; i < partitions.size(); ++i)
    ASSERT_TRUE(restore(partitions[i]).ok()) << i;
  starter.join();
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(*started, 3);
  for (float x : rank1->replica().x()) ASSERT_EQ(x, 0.25f);
}

// Weights changed after a step on every rank (design.md 4, "Weights changed
// after a step"): both ranks clamp x after step 2 (in the warmup) and halve
// it after step 4 (compressing); ReloadModel gives the shards rank 0's x
// and rank 1 waits until they hold its own. After every step both ranks'
// x equal the simulator's fed the same gradients and changes, bit for bit;
// HoldsShardsModel tells the shards' x from a changed one (by hashes).
TEST(SessionTest, WeightsChangedAfterAStepOnEveryRankMatchTheSimulator) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 1000 }
    lr { lr: 0.01 }
    steps: 8
    freeze_step: 3
    block_elems: 16
    partition_elems: 256
    timeouts { connect_seconds: 20 }
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  TwoRanks two(config, job);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  std::vector<std::unique_ptr<worker::Session>>& ranks = two.ranks;
  const auto both = [&](auto&& f) { return two.Both(f); };
  auto sim =
      compress::Simulator::Create(job.algorithm, ranks[0]->replica().x());
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (int64_t step = 0; step < 8; ++step) {
    ASSERT_NO_FATAL_FAILURE(two.StepLikeTheSimulator(*sim, step));
    if (step != 2 && step != 4) continue;
    // Between steps every rank holds the shards' model (their hashes of x
    // match: the model stays on the shards).
    for (uint32_t r = 0; r < 2; ++r) {
      auto holds = ranks[r]->HoldsShardsModel();
      ASSERT_TRUE(holds.ok()) << holds.status();
      EXPECT_TRUE(*holds) << "rank " << r << " after step " << step;
    }
    std::vector<float> changed(ranks[0]->replica().x().begin(),
                               ranks[0]->replica().x().end());
    const std::vector<float> before = changed;
    for (float& f : changed)
      f = step == 2 ? std::min(std::max(f, -0.02f), 0.02f) : 0.5f * f;
    ASSERT_NE(changed, before) << "the change after step " << step;
    ASSERT_TRUE(sim->ReplaceX(changed).ok());
    for (auto& rank : ranks)
      std::copy(changed.begin(), changed.end(), rank->replica().x().begin());
    // Changed, and not yet given to the shards.
    auto holds = ranks[1]->HoldsShardsModel();
    ASSERT_TRUE(holds.ok()) << holds.status();
    EXPECT_FALSE(*holds) << "after the change after step " << step;
    auto reloaded =
        both([&](worker::Session& s, uint32_t) { return s.ReloadModel(); });
    ASSERT_TRUE(reloaded.first.ok()) << reloaded.first;
    ASSERT_TRUE(reloaded.second.ok()) << reloaded.second;
    for (uint32_t r = 0; r < 2; ++r) {
      auto given = ranks[r]->HoldsShardsModel();
      ASSERT_TRUE(given.ok()) << given.status();
      EXPECT_TRUE(*given) << "rank " << r
                          << " after the shards took the change";
    }
  }
}

// A shard killed between two steps and restarted from its checkpoint is
// behind the ranks until their replays bring it forward (design.md 4). A
// rank that asks the shards between steps does that first
// (ShardRecovery::CatchUpBetweenSteps): rank 0's server error buffers and
// rank 1's HoldsShardsModel after a kill in the warmup, whose clipped step
// then waits for its commit again (Session::CatchUpShards); ReloadModel on
// both ranks after a kill in the compression phase, where the ranks then
// change their weights. Every step's x is the simulator's, and the server
// error buffers after the catch-up are the ones before the kill.
TEST(SessionTest, AShardRestartedBetweenStepsIsCaughtUpByTheRanksThatAsk) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 1000 }
    lr { lr: 0.01 }
    steps: 8
    freeze_step: 4
    block_elems: 16
    partition_elems: 256
    clip_grad_norm: 1.0
    checkpoint { every_steps: 2 }
    timeouts { connect_seconds: 20 recovery_seconds: 20 }
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  TwoRanks two(config, job);
  two.cluster().AddServerArgs({"--checkpoint_dir=" + two.cluster().dir()});
  ASSERT_NO_FATAL_FAILURE(two.Start());
  std::vector<std::unique_ptr<worker::Session>>& ranks = two.ranks;
  auto sim =
      compress::Simulator::Create(job.algorithm, ranks[0]->replica().x());
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (int64_t step = 0; step < 8; ++step) {
    ASSERT_NO_FATAL_FAILURE(two.StepLikeTheSimulator(*sim, step));
    if (step != 2 && step != 4) continue;
    // Shard 1's last checkpoint is of the step before this one.
    std::vector<float> before(1000), after(1000);
    ASSERT_TRUE(ranks[0]->ServerError(absl::MakeSpan(before)).ok());
    two.cluster().KillServer(1);
    two.cluster().RestartServer(1, false);
    if (step == 2) {
      auto asked = two.Both([&](worker::Session& s, uint32_t r) {
        if (r == 0) return s.ServerError(absl::MakeSpan(after));
        absl::StatusOr<bool> holds = s.HoldsShardsModel();
        if (!holds.ok()) return holds.status();
        return *holds
                   ? absl::OkStatus()
                   : absl::InternalError("the shards do not hold rank 1's x");
      });
      ASSERT_TRUE(asked.first.ok()) << asked.first;
      ASSERT_TRUE(asked.second.ok()) << asked.second;
      EXPECT_EQ(before, after) << "the server error buffers after the catch-up";
      continue;
    }
    std::vector<float> changed(ranks[0]->replica().x().begin(),
                               ranks[0]->replica().x().end());
    for (float& f : changed) f = std::min(std::max(f, -0.02f), 0.02f);
    ASSERT_TRUE(sim->ReplaceX(changed).ok());
    for (auto& rank : ranks)
      std::copy(changed.begin(), changed.end(), rank->replica().x().begin());
    auto reloaded =
        two.Both([&](worker::Session& s, uint32_t) { return s.ReloadModel(); });
    ASSERT_TRUE(reloaded.first.ok()) << reloaded.first;
    ASSERT_TRUE(reloaded.second.ok()) << reloaded.second;
    for (uint32_t r = 0; r < 2; ++r) {
      auto holds = ranks[r]->HoldsShardsModel();
      ASSERT_TRUE(holds.ok()) << holds.status();
      EXPECT_TRUE(*holds) << "rank " << r << " after the change";
    }
    ASSERT_TRUE(ranks[0]->ServerError(absl::MakeSpan(after)).ok());
    EXPECT_EQ(before, after) << "the server error buffers after the change";
  }
}

// zero_one_adam's local interval (design.md 2.7), as morse.torch saves and
// restores it: between steps inside one (steps 4 and 5 are local, the sync
// of step 3 completed 4), SavedInterval gives the interval's state and
// ShardsAtSync the shards' m at its last sync, which is the workers' m
// right after it. Restore refuses an interval's state outside an interval,
// none inside one, and one of another last local step, changing nothing;
// given each rank's own, against shards that hold the sync already, it
// leaves the run as it was (the steps after it the simulator's).
TEST(SessionTest, ALocalIntervalsStateIsSavedRestoredAndMisuseRefused) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 1000 }
    optimizer: "zero_one_adam"
    zero_one_adam { var_freeze_step: 2 var_update_scaler: 1 local_step_scaler: 1 local_step_clipper: 4 }
    lr { lr: 0.01 }
    steps: 8
    block_elems: 16
    partition_elems: 256
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  TwoRanks two(config, job);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  std::vector<std::unique_ptr<worker::Session>>& ranks = two.ranks;
  auto sim =
      compress::Simulator::Create(job.algorithm, ranks[0]->replica().x());
  ASSERT_TRUE(sim.ok()) << sim.status();
  std::vector<float> m_at_sync;
  for (int64_t step = 0; step < 6; ++step) {
    ASSERT_NO_FATAL_FAILURE(two.StepLikeTheSimulator(*sim, step));
    if (step == 3) {
      m_at_sync.assign(ranks[0]->replica().m().begin(),
                       ranks[0]->replica().m().end());
      EXPECT_EQ(ranks[0]->SavedInterval().status().code(),
                absl::StatusCode::kFailedPrecondition)
          << "right after a sync";
    }
  }
  ASSERT_EQ(ranks[0]->exchanged_step(), 4);
  std::vector<float> shards_m(1000), server_error(1000);
  ASSERT_TRUE(
      ranks[0]
          ->ShardsAtSync(absl::MakeSpan(shards_m), absl::MakeSpan(server_error))
          .ok());
  EXPECT_EQ(shards_m, m_at_sync);
  EXPECT_NE(shards_m, std::vector<float>(ranks[0]->replica().m().begin(),
                                         ranks[0]->replica().m().end()))
      << "the local steps moved the worker's m";

  struct Saved {
    std::vector<float> m, v, error;
    worker::Session::IntervalState interval;
  };
  std::vector<Saved> saved(2);
  for (uint32_t r = 0; r < 2; ++r) {
    worker::Session& s = *ranks[r];
    auto interval = s.SavedInterval();
    ASSERT_TRUE(interval.ok()) << interval.status();
    EXPECT_EQ(interval->last_local_step, 5);
    saved[r] = {{s.replica().m().begin(), s.replica().m().end()},
                {s.replica().v().begin(), s.replica().v().end()},
                std::vector<float>(1000),
                *std::move(interval)};
    s.error().Read(0, absl::MakeSpan(saved[r].error));
  }
  const uint64_t before = ranks[0]->replica().Checksum();
  worker::Session::IntervalState wrong = saved[0].interval;
  wrong.last_local_step = 4;
  for (const auto& [step, interval] :
       {std::pair{int64_t{6},
                  static_cast<worker::Session::IntervalState*>(nullptr)},
        {int64_t{4}, &saved[0].interval},
        {int64_t{6}, &wrong}}) {
    const absl::Status refused = ranks[0]->Restore(
        step, saved[0].m, saved[0].v, saved[0].error, {}, nullptr, interval);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument)
        << "step " << step << ": " << refused;
  }
  EXPECT_EQ(ranks[0]->replica().Checksum(), before);
  EXPECT_EQ(ranks[0]->step(), 6);

  auto restored = two.Both([&](worker::Session& s, uint32_t r) {
    return s.Restore(6, saved[r].m, saved[r].v, saved[r].error, {}, nullptr,
                     &saved[r].interval);
  });
  ASSERT_TRUE(restored.first.ok()) << restored.first;
  ASSERT_TRUE(restored.second.ok()) << restored.second;
  for (int64_t step = 6; step < 8; ++step)
    ASSERT_NO_FATAL_FAILURE(two.StepLikeTheSimulator(*sim, step));
}

// A step whose workers clip the averaged gradient (morse.torch's
// clip_grad_norm_): after ClipAt, AverageGradient gives the replies' decoded
// values, the mean of the two ranks' gradients (fp32, exact here), whose
// norms are AverageNorm's; before ClipAt, with the wrong size, or in a
// compressing step it says why, and the step goes on.
TEST(SessionTest, TheAveragedGradientOfAClippedStepIsTheMeanOfTheRanks) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 1000 }
    lr { lr: 0.01 }
    steps: 4
    freeze_step: 1
    block_elems: 16
    partition_elems: 256
    timeouts { connect_seconds: 20 }
  )";
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  TwoRanks two(config, job);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  const auto both = [&](auto&& f) { return two.Both(f); };
  // Powers of two: their mean is exact in fp32.
  std::vector<std::vector<float>> grads(2, std::vector<float>(1000));
  for (size_t i = 0; i < 1000; ++i) {
    grads[0][i] = static_cast<float>(i % 7) * 0.25f;
    grads[1][i] = -static_cast<float>(i % 5) * 0.5f;
  }
  std::vector<float> want(1000);
  for (size_t i = 0; i < 1000; ++i) want[i] = (grads[0][i] + grads[1][i]) / 2;
  std::vector<float> got[2] = {std::vector<float>(1000),
                               std::vector<float>(1000)};
  // Step 0 averages (the warmup); step 1 compresses.
  for (int64_t step = 0; step < 2; ++step) {
    auto stepped = both([&](worker::Session& s, uint32_t r) -> absl::Status {
      if (absl::Status st = s.SetStepClipping(true); !st.ok()) return st;
      if (absl::Status st = s.Begin(grads[r]); !st.ok()) return st;
      const absl::Status early = s.AverageGradient(absl::MakeSpan(got[r]));
      if (early.code() != absl::StatusCode::kFailedPrecondition) {
        return absl::InternalError(
            absl::StrCat("before ClipAt: ", early.ToString()));
      }
      // A clip of part of the model takes the averaged gradient too.
      const compress::ClipPieces half = {{500, 0.5f}, {1000, 1.0f}};
      if (s.ClipPiecesAt(half).code() != absl::StatusCode::kFailedPrecondition)
        return absl::InternalError("clip pieces before ClipAt");
      absl::StatusOr<double> sum = s.ClipAt(0.0f);
      if (!sum.ok()) return sum.status();
      const absl::Status read = s.AverageGradient(absl::MakeSpan(got[r]));
      if (step == 1) {
        if (read.code() != absl::StatusCode::kFailedPrecondition) {
          return absl::InternalError(
              absl::StrCat("a compressing step: ", read.ToString()));
        }
        if (s.ClipPiecesAt(half).code() !=
            absl::StatusCode::kFailedPrecondition) {
          return absl::InternalError("clip pieces in a compressing step");
        }
      } else {
        if (s.ClipPiecesAt({{500, 0.5f}}).code() !=
                absl::StatusCode::kInvalidArgument ||
            s.ClipPiecesAt({{1000, std::numeric_limits<float>::infinity()}})
                    .code() != absl::StatusCode::kInvalidArgument) {
          return absl::InternalError("malformed clip pieces taken");
        }
        // Step 0 ends with these: its commit carries them to the shards,
        // whose mirrors must take them for step 1's pushes to go on.
        if (absl::Status st = s.ClipPiecesAt(half); !st.ok()) return st;
        if (!read.ok()) return read;
        const absl::Status wrong =
            s.AverageGradient(absl::MakeSpan(got[r]).first(999));
        if (wrong.code() != absl::StatusCode::kInvalidArgument) {
          return absl::InternalError(
              absl::StrCat("999 floats: ", wrong.ToString()));
        }
        absl::StatusOr<double> l1 = s.AverageNorm(1.0);
        if (!l1.ok()) return l1.status();
        double sum_abs = 0.0, sum_squares = 0.0;
        for (float g : got[r]) {
          sum_abs += std::abs(g);
          sum_squares += static_cast<double>(g) * g;
        }
        if (std::abs(*l1 - sum_abs) > 1e-9 * sum_abs ||
            std::abs(*sum - sum_squares) > 1e-9 * sum_squares) {
          return absl::InternalError(
              absl::StrCat("norms ", *l1, " and ", *sum, " against ", sum_abs,
                           " and ", sum_squares, " of the averaged gradient"));
        }
      }
      return s.Finish();
    });
    ASSERT_TRUE(stepped.first.ok()) << "step " << step << ": " << stepped.first;
    ASSERT_TRUE(stepped.second.ok())
        << "step " << step << ": " << stepped.second;
    if (step == 0) {
      for (uint32_t r = 0; r < 2; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
    }
  }
  // The shards' mirrors applied step 0's pieces as the workers did.
  auto held = both([&](worker::Session& s, uint32_t) -> absl::Status {
    absl::StatusOr<bool> holds = s.HoldsShardsModel();
    if (!holds.ok()) return holds.status();
    return *holds ? absl::OkStatus()
                  : absl::InternalError("the shards' model differs");
  });
  EXPECT_TRUE(held.first.ok()) << held.first;
  EXPECT_TRUE(held.second.ok()) << held.second;
}

// Edits after the clip (design.md 2.6): in a step that averages, after
// ClipAt, ClippedAverage gives the average scaled by the clip factor, and
// AmendAt makes another gradient the step's. Both ranks, both shards'
// mirrors and a replica fed that gradient agree after the step, the next
// step's pushes carrying it too; AmendAt before ClipAt, in a compressing
// step, of the wrong size or with a NaN says why and changes nothing.
TEST(SessionTest, AnAmendedStepIsEveryReplicasAndMirrors) {
  const std::string config = R"(
    workers: 2
    shards: 2
    synthetic { dim: 2000000 }
    lr { lr: 0.01 }
    steps: 4
    freeze_step: 2
    partition_elems: 65536
    timeouts { connect_seconds: 20 }
  )";
  // Each shard's part of the model (4 MB in fp32) is more than a message
  // may hold (16 bytes a value of the largest partition, and 1 MiB): the
  // commit goes a partition at a time.
  constexpr size_t kDim = 2000000;
  auto job = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_GT(4 * kDim / 2, static_cast<size_t>(proto::MaxMessageBytes(job)));
  TwoRanks two(config, job);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  // Powers of two: their mean is exact in fp32.
  std::vector<std::vector<float>> grads(2, std::vector<float>(kDim));
  std::vector<float> mean(kDim);
  for (size_t i = 0; i < kDim; ++i) {
    grads[0][i] = static_cast<float>(i % 7) * 0.25f;
    grads[1][i] = -static_cast<float>(i % 5) * 0.5f;
    mean[i] = (grads[0][i] + grads[1][i]) / 2;
  }
  // What a script's edit made of the clipped average: no clip factor.
  std::vector<float> amended(kDim);
  for (size_t i = 0; i < kDim; ++i)
    amended[i] = 0.001f * static_cast<float>(i % 13) - 0.004f;
  compress::Replica expected(job.algorithm, {0, kDim});
  {
    const auto x = two.ranks[0]->replica().x();
    std::copy(x.begin(), x.end(), expected.x().begin());
  }
  for (int64_t step = 0; step < 3; ++step) {
    auto stepped = two.Both([&](worker::Session& s,
                                uint32_t r) -> absl::Status {
      if (absl::Status st = s.SetStepClipping(step != 1); !st.ok()) return st;
      if (absl::Status st = s.Begin(grads[r]); !st.ok()) return st;
      if (step == 1) return s.Finish();  // its pushes carry step 0's amendment
      if (s.AmendAt(amended).code() != absl::StatusCode::kFailedPrecondition)
        return absl::InternalError("amended before ClipAt");
      absl::StatusOr<double> sum = s.ClipAt(1.0f);
      if (!sum.ok()) return sum.status();
      if (step == 2) {  // a compressing step: each worker clips its own
        return s.AmendAt(amended).code() ==
                       absl::StatusCode::kFailedPrecondition
                   ? s.Finish()
                   : absl::InternalError("amended a compressing step");
      }
      std::vector<float> clipped(kDim);
      if (absl::Status st = s.ClippedAverage(absl::MakeSpan(clipped)); !st.ok())
        return st;
      const float scale = compress::ClipScale(*sum, 1.0f);
      if (!(scale < 1.0f)) return absl::InternalError("the step did not clip");
      for (size_t i = 0; i < kDim; ++i) {
        const float want = mean[i] * scale;
        if (std::memcmp(&want, &clipped[i], 4) != 0) {
          return absl::InternalError(
              absl::StrCat("element ", i, ": ", clipped[i],
                           " of the clipped average, not ", want));
        }
      }
      std::vector<float> wrong = amended;
      wrong.pop_back();
      if (s.AmendAt(wrong).code() != absl::StatusCode::kInvalidArgument)
        return absl::InternalError("one float short amended");
      wrong = amended;
      wrong[3] = std::nanf("");
      if (s.AmendAt(wrong).code() != absl::StatusCode::kInvalidArgument)
        return absl::InternalError("a NaN amended");
      if (absl::Status st = s.AmendAt(amended); !st.ok()) return st;
      if (absl::Status st = s.ClippedAverage(absl::MakeSpan(clipped)); !st.ok())
        return st;
      if (clipped != amended)
        return absl::InternalError("the step's gradient is not the amended");
      return s.Finish();
    });
    ASSERT_TRUE(stepped.first.ok()) << "step " << step << ": " << stepped.first;
    ASSERT_TRUE(stepped.second.ok())
        << "step " << step << ": " << stepped.second;
    if (step == 2) break;
    if (step == 0) {
      // Rank 1 restarted from its checkpoint after the amended step: its
      // step 1 pushes carry the amendment again (the shards would refuse
      // them without it).
      const std::string path = ::testing::TempDir() + "/amended_rank1.ckpt";
      ASSERT_TRUE(two.ranks[1]->SaveCheckpoint(path).ok());
      two.ranks[1].reset();
      auto session = worker::Session::Connect(
          job, 1,
          {two.cluster().server_address(0), two.cluster().server_address(1)},
          proto::Insecure());
      ASSERT_TRUE(session.ok()) << session.status();
      two.ranks[1] = *std::move(session);
      absl::StatusOr<int64_t> started = two.ranks[1]->Start(true, path);
      ASSERT_TRUE(started.ok()) << started.status();
      ASSERT_EQ(*started, 1);
    }
    const std::vector<float>& g = step == 0 ? amended : mean;
    ASSERT_TRUE(expected
                    .ApplyReply(step, 0, kDim,
                                {reinterpret_cast<const uint8_t*>(g.data()),
                                 4 * g.size()},
                                nullptr, 1.0f, nullptr, {}, /*amended=*/true)
                    .ok());
    for (uint32_t r = 0; r < 2; ++r) {
      const auto x = two.ranks[r]->replica().x();
      EXPECT_TRUE(std::equal(x.begin(), x.end(), expected.x().begin()))
          << "rank " << r << " after step " << step;
      absl::StatusOr<bool> holds = two.ranks[r]->HoldsShardsModel();
      ASSERT_TRUE(holds.ok()) << holds.status();
      EXPECT_TRUE(*holds) << "rank " << r << " after step " << step;
    }
  }
}

}  // namespace
}  // namespace morse
