// A worker session against a real server: a step that fails (here: the
// other rank never pushes, so the shard times the step out) ends training,
// and a retried step is refused rather than applying replies twice.
#include "worker/session.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "compress/layout.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/compress/test_util.h"
#include "tests/e2e/cluster.h"
#include "worker/transport/grpc/transport.h"

namespace morse {
namespace {

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
  testing::Cluster cluster(config, 2, 0);
  cluster.StartServers(false);
  const std::vector<std::string> servers = {cluster.server_address(0),
                                            cluster.server_address(1)};
  std::vector<std::unique_ptr<worker::Session>> ranks(2);
  for (uint32_t r = 0; r < 2; ++r) {
    auto session = worker::Session::Connect(job, r, servers, proto::Insecure());
    ASSERT_TRUE(session.ok()) << session.status();
    ranks[r] = *std::move(session);
  }
  // Both at once: each waits for the other to join.
  const auto both = [&](auto&& f) {
    absl::Status status[2];
    std::thread other([&] { status[1] = f(*ranks[1], 1); });
    status[0] = f(*ranks[0], 0);
    other.join();
    return std::make_pair(status[0], status[1]);
  };
  auto started = both(
      [](worker::Session& s, uint32_t) { return s.Start(false).status(); });
  ASSERT_TRUE(started.first.ok()) << started.first;
  ASSERT_TRUE(started.second.ok()) << started.second;
  auto sim =
      compress::Simulator::Create(job.algorithm, ranks[0]->replica().x());
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (int64_t step = 0; step < 8; ++step) {
    std::vector<std::vector<float>> grads;
    for (uint32_t r = 0; r < 2; ++r)
      grads.push_back(compress::testing::VariedData(1000, 10 * step + r));
    auto stepped =
        both([&](worker::Session& s, uint32_t r) { return s.Step(grads[r]); });
    ASSERT_TRUE(stepped.first.ok()) << stepped.first;
    ASSERT_TRUE(stepped.second.ok()) << stepped.second;
    const std::vector<absl::Span<const float>> spans = {grads[0], grads[1]};
    ASSERT_TRUE(sim->Step(spans).ok());
    for (uint32_t r = 0; r < 2; ++r) {
      const auto x = ranks[r]->replica().x();
      ASSERT_TRUE(std::equal(x.begin(), x.end(), sim->worker_x(r).begin()))
          << "rank " << r << " after step " << step;
    }
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

}  // namespace
}  // namespace morse
