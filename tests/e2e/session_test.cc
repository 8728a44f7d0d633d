// A worker session against a real server: a step that fails (here: the
// other rank never pushes, so the shard times the step out) ends training,
// and a retried step is refused rather than applying replies twice.
#include "worker/session.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "compress/layout.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
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

}  // namespace
}  // namespace morse
