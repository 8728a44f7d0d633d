// GrpcTransport against a running morse-server: a worker's pushes to a
// shard upload in turn (JobConfig.uploads_per_shard), each freeing its turn
// as the shard says it has arrived, not when its reply comes. A shard
// replies to a partition only once every worker has pushed it, so a turn
// held until the reply would deadlock two workers that push the same
// partitions in different orders.
#include "worker/transport/grpc/transport.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "compress/codec.h"
#include "compress/layout.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "proto/morse.grpc.pb.h"
#include "proto/security.h"
#include "proto/wire.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

// D = 1000 in blocks of 16 and partitions of 256: 4 partitions on 1 shard;
// fp32 Adam, so every step averages the workers' fp32 gradients.
constexpr char kConfig[] = R"(
  workers: 2
  shards: 1
  synthetic { dim: 1000 }
  optimizer: "adam"
  lr { lr: 0.01 }
  steps: 100
  block_elems: 16
  partition_elems: 256
  uploads_per_shard: 1
)";

class TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = *proto::ParseJobConfig(kConfig, proto::ConfigFormat::kText);
    ASSERT_EQ(job_.uploads_per_shard, 1u);
    layout_ = std::make_unique<compress::Layout>(
        *compress::Layout::Create(job_.algorithm.layout));
    ASSERT_EQ(layout_->partitions().size(), 4u);
    cluster_ = std::make_unique<testing::Cluster>(kConfig, 1, 2);
    cluster_->StartServers(false);
    auto stub = v1::ParameterServer::NewStub(grpc::CreateChannel(
        cluster_->server_address(0), grpc::InsecureChannelCredentials()));
    for (const compress::Partition& p : layout_->partitions()) {
      v1::InitPartitionRequest init;
      init.set_rank(0);
      init.set_partition(p.id);
      init.set_layout_fingerprint(layout_->fingerprint());
      const std::vector<float> x0(p.range.size(), 0.5f);
      init.set_values(reinterpret_cast<const char*>(x0.data()), 4 * x0.size());
      grpc::ClientContext context;
      context.set_wait_for_ready(true);
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::seconds(20));
      v1::InitPartitionReply reply;
      const grpc::Status status = stub->InitPartition(&context, init, &reply);
      ASSERT_TRUE(status.ok()) << status.error_message() << "\n"
                               << testing::ReadFile(cluster_->server_log(0));
    }
  }

  // Rank `rank`'s fp32 push of `partition` at step 0: every element `value`.
  v1::PushRequest Fp32Push(uint32_t rank, uint32_t partition, float value) {
    const compress::Partition& p = layout_->partitions()[partition];
    const std::vector<float> g(p.range.size(), value);
    v1::PushRequest request;
    request.set_step(0);
    request.set_rank(rank);
    request.set_partition(partition);
    request.set_layout_fingerprint(layout_->fingerprint());
    request.set_codec(proto::ToWire(compress::CodecKind::kFp32));
    request.set_payload(
        std::string(reinterpret_cast<const char*>(g.data()), 4 * g.size()));
    return request;
  }

  proto::JobSpec job_;
  std::unique_ptr<compress::Layout> layout_;
  std::unique_ptr<testing::Cluster> cluster_;
};

TEST_F(TransportTest, PushesInOppositeOrdersAllGetTheirReplies) {
  const std::vector<std::string> servers = {cluster_->server_address(0)};
  std::vector<std::unique_ptr<worker::GrpcTransport>> transports;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto transport =
        worker::GrpcTransport::Create(job_, servers, rank, proto::Insecure());
    ASSERT_TRUE(transport.ok()) << transport.status();
    transports.push_back(*std::move(transport));
  }
  // Rank 0 pushes partitions 0, 1, 2, 3 and rank 1 pushes 3, 2, 1, 0, each
  // as one burst: with one upload a shard at a time, rank 0's push of
  // partition 1 waits for its push of 0, whose reply waits for rank 1's
  // push of 0, the last of rank 1's.
  const size_t n = layout_->partitions().size();
  struct Call {
    v1::PushRequest request;
    v1::PushReply reply;
    absl::Status status;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t partition =
          static_cast<uint32_t>(rank == 0 ? i : n - 1 - i);
      calls.push_back(std::make_unique<Call>());
      calls.back()->request =
          Fp32Push(rank, partition, rank == 0 ? 1.0f : 3.0f);
    }
  }
  worker::CallOptions options;
  options.timeout_seconds = 20;
  for (size_t c = 0; c < calls.size(); ++c) {
    Call* call = calls[c].get();
    transports[c / n]->Push(0, call->request, &call->reply, options,
                            [call](absl::Status status) {
                              call->status = std::move(status);
                              call->done.Notify();
                            });
  }
  for (const auto& call : calls) {
    call->done.WaitForNotification();
    ASSERT_TRUE(call->status.ok())
        << "rank " << call->request.rank() << ", partition "
        << call->request.partition() << ": " << call->status << "\n"
        << testing::ReadFile(cluster_->server_log(0));
    EXPECT_EQ(call->reply.step(), 0);
    EXPECT_EQ(call->reply.partition(), call->request.partition());
    // The reply is the workers' average gradient, (1 + 3) / 2 everywhere.
    const std::string& payload = call->reply.payload();
    ASSERT_EQ(
        payload.size(),
        4 * layout_->partitions()[call->request.partition()].range.size());
    std::vector<float> average(payload.size() / 4);
    std::memcpy(average.data(), payload.data(), payload.size());
    for (float a : average) ASSERT_EQ(a, 2.0f);
  }
}

}  // namespace
}  // namespace morse
