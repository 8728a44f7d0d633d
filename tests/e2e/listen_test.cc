// morse-server's listening port is its own: a second shard started on the
// address of a running one stops with a message (exit 3) instead of
// sharing the port. gRPC's default on Linux, SO_REUSEPORT, let both listen,
// so that the kernel spread the workers' connections over them: a job's
// workers could join another job's shard (a fault campaign on CI once
// found its ranks talking to another test's shard this way).
#include <chrono>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/morse.grpc.pb.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

// The shard's answer on a fresh connection (a channel of its own).
grpc::Status ShardInfoOn(const std::string& address, int connection,
                         v1::ShardInfo* info) {
  grpc::ChannelArguments args;
  args.SetInt("morse.test.connection", connection);
  auto stub = v1::ParameterServer::NewStub(grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  return stub->GetShardInfo(&context, v1::ShardInfoRequest(), info);
}

TEST(ListenTest, AShardOnATakenAddressStopsAndTheFirstKeepsIt) {
  testing::Cluster cluster(
      "workers: 1 shards: 1 synthetic { dim: 1000 } lr { lr: 0.1 } steps: 1 "
      "freeze_step: 1",
      1, 0);
  cluster.StartServers(false);
  const std::string address = cluster.server_address(0);
  // The first shard answers before the second starts (StartServers does
  // not wait for it to listen).
  v1::ShardInfo first;
  const grpc::Status up = ShardInfoOn(address, -1, &first);
  ASSERT_TRUE(up.ok()) << up.error_message()
                       << testing::ReadFile(cluster.server_log(0));
  ASSERT_EQ(first.range_end(), 1000u);
  // Another job's shard, on the same address.
  const std::string other_config = cluster.dir() + "/other.textproto";
  std::ofstream(other_config) << "workers: 2 shards: 1 synthetic { dim: 5000 } "
                                 "lr { lr: 0.1 } steps: 1 freeze_step: 1\n";
  const std::string log = cluster.dir() + "/second.log";
  testing::Process second({testing::ServerBin(), "--config", other_config,
                           "--shard", "0", "--insecure", "--listen", address},
                          log);
  int code = -1;
  ASSERT_TRUE(second.Wait(absl::Seconds(30), &code))
      << "a second shard listens on " << address << " beside the first";
  EXPECT_EQ(code, 3) << testing::ReadFile(log);
  EXPECT_NE(testing::ReadFile(log).find(
                absl::StrCat("cannot listen on ", address, " (in use")),
            std::string::npos)
      << testing::ReadFile(log);
  // Every new connection reaches the first shard: its job's model.
  for (int i = 0; i < 8; ++i) {
    v1::ShardInfo info;
    const grpc::Status status = ShardInfoOn(address, i, &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(info.workers(), 1u) << "connection " << i;
    EXPECT_EQ(info.range_end(), 1000u) << "connection " << i;
  }
}

}  // namespace
}  // namespace morse
