// morse-server --health_listen: the gRPC health service, alone and in
// plaintext, on its own port (kubelet gRPC probes cannot speak TLS).
#include <memory>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/morse.grpc.pb.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/proto/health.grpc.pb.h"

namespace morse {
namespace {

TEST(HealthTest, TheProbePortServesHealthAndNothingElse) {
  const int port = testing::FreePort();
  testing::Cluster cluster(
      "workers: 1 shards: 1 synthetic { dim: 1000 } lr { lr: 0.1 } steps: 1 "
      "freeze_step: 1",
      1, 0);
  cluster.AddServerArgs({absl::StrCat("--health_listen=127.0.0.1:", port)});
  cluster.StartServers(false);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = health->Check(
      &context, grpc::health::v1::HealthCheckRequest(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message()
                           << testing::ReadFile(cluster.server_log(0));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  // The parameter-server service is not on the probe port.
  auto ps = v1::ParameterServer::NewStub(channel);
  grpc::ClientContext other;
  other.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
  v1::ShardInfo info;
  EXPECT_EQ(
      ps->GetShardInfo(&other, v1::ShardInfoRequest(), &info).error_code(),
      grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace morse
