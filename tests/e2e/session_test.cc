// A worker session against a real server: a step that fails (here: the
// other rank never pushes, so the shard times the step out) ends training,
// and a retried step is refused rather than applying replies twice.
#include "worker/session.h"

#include <vector>

#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "tests/e2e/cluster.h"

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

}  // namespace
}  // namespace morse
