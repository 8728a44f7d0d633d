// Bad input against a running morse-server: every malformed or out-of-turn
// push gets the status code DESIGN 4 names, and the shard's state (its
// mirror checksum and progress) is exactly as before.
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <vector>

#include "compress/codec.h"
#include "compress/layout.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "proto/morse.grpc.pb.h"
#include "proto/wire.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

// D = 1000 in blocks of 16 and partitions of 256: 4 partitions on 1 shard.
// Two warmup steps, then sign1.
constexpr char kConfig[] = R"(
  workers: 2
  shards: 1
  synthetic { dim: 1000 }
  lr { lr: 0.01 }
  steps: 100
  freeze_step: 2
  block_elems: 16
  partition_elems: 256
  timeouts { step_seconds: 1 recovery_seconds: 2 }
)";

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = *proto::ParseJobConfig(kConfig, proto::ConfigFormat::kText);
    layout_ = std::make_unique<compress::Layout>(
        *compress::Layout::Create(job_.algorithm.layout));
    cluster_ = std::make_unique<testing::Cluster>(kConfig, 1, 2);
    cluster_->StartServers(false);
    stub_ = v1::ParameterServer::NewStub(grpc::CreateChannel(
        cluster_->server_address(0), grpc::InsecureChannelCredentials()));
    v1::ShardInfo info;
    ASSERT_TRUE(Info(&info, /*wait_for_ready=*/true).ok())
        << testing::ReadFile(cluster_->server_log(0));
    // Rank 0 uploads x0 = 0.5 everywhere, then both ranks run steps 0 and 1.
    for (const compress::Partition& p : layout_->partitions()) {
      v1::InitPartitionRequest init;
      init.set_rank(0);
      init.set_partition(p.id);
      init.set_layout_fingerprint(layout_->fingerprint());
      const std::vector<float> x0(p.range.size(), 0.5f);
      init.set_values(reinterpret_cast<const char*>(x0.data()), 4 * x0.size());
      grpc::ClientContext context;
      v1::InitPartitionReply reply;
      ASSERT_TRUE(stub_->InitPartition(&context, init, &reply).ok());
    }
    for (int64_t step = 0; step < 2; ++step) {
      for (const compress::Partition& p : layout_->partitions()) {
        auto other = std::async(std::launch::async,
                                [&] { return Send(Fp32Push(step, 1, p.id)); });
        const auto mine = Send(Fp32Push(step, 0, p.id));
        ASSERT_TRUE(mine.first.ok()) << mine.first.error_message();
        ASSERT_TRUE(other.get().first.ok());
      }
    }
    ASSERT_TRUE(Info(&before_).ok());
    ASSERT_EQ(before_.completed_steps(), 2);
    ASSERT_NE(before_.mirror_checksum(),
              0u);  // requested, so the comparisons mean something
  }

  grpc::Status Info(v1::ShardInfo* info, bool wait_for_ready = false) {
    grpc::ClientContext context;
    context.set_wait_for_ready(wait_for_ready);
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    v1::ShardInfoRequest request;
    request.set_mirror_checksum(true);
    return stub_->GetShardInfo(&context, request, info);
  }

  std::pair<grpc::Status, v1::PushReply> Send(const v1::PushRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(20));
    v1::PushReply reply;
    grpc::Status status = stub_->Push(&context, request, &reply);
    return {status, reply};
  }

  v1::PushRequest Push(int64_t step, uint32_t rank, uint32_t partition,
                       compress::CodecKind kind, float value) {
    const compress::Partition& p = layout_->partitions()[partition];
    compress::CodecSpec spec{kind, job_.algorithm.layout.block_elems};
    const std::vector<float> x(p.range.size(), value);
    std::string payload(compress::PayloadBytes(spec, x.size()), '\0');
    EXPECT_TRUE(compress::Encode(spec, x, {},
                                 {reinterpret_cast<uint8_t*>(payload.data()),
                                  payload.size()})
                    .ok());
    v1::PushRequest request;
    request.set_step(step);
    request.set_rank(rank);
    request.set_partition(partition);
    request.set_layout_fingerprint(layout_->fingerprint());
    request.set_codec(proto::ToWire(kind));
    request.set_payload(payload);
    return request;
  }
  v1::PushRequest Fp32Push(int64_t step, uint32_t rank, uint32_t partition) {
    return Push(step, rank, partition, compress::CodecKind::kFp32,
                0.1f * (rank + 1) + step);
  }
  v1::PushRequest Sign1Push(uint32_t rank) {
    return Push(2, rank, 0, compress::CodecKind::kSign1, -0.25f);
  }

  // The push fails with `code`, its message contains `words`, and the shard
  // is unchanged.
  void ExpectRejected(const v1::PushRequest& request, grpc::StatusCode code,
                      const std::string& words) {
    const auto [status, reply] = Send(request);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_NE(status.error_message().find(words), std::string::npos)
        << status.error_message();
    v1::ShardInfo after;
    ASSERT_TRUE(Info(&after).ok());
    EXPECT_EQ(after.mirror_checksum(), before_.mirror_checksum());
    EXPECT_EQ(after.completed_steps(), before_.completed_steps());
  }

  proto::JobSpec job_;
  std::unique_ptr<compress::Layout> layout_;
  std::unique_ptr<testing::Cluster> cluster_;
  std::unique_ptr<v1::ParameterServer::Stub> stub_;
  v1::ShardInfo before_;
};

TEST_F(BadInputTest, PayloadOfTheWrongLength) {
  v1::PushRequest request = Sign1Push(0);
  request.mutable_payload()->pop_back();
  ExpectRejected(request, grpc::StatusCode::INVALID_ARGUMENT, "bytes");
}

// Bytes that are not a PushRequest at all (Push is a raw method on the
// server, which parses the request itself).
TEST_F(BadInputTest, BytesThatAreNotAPushRequest) {
  grpc::GenericStub generic(grpc::CreateChannel(
      cluster_->server_address(0), grpc::InsecureChannelCredentials()));
  const std::string garbage =
      "\x0a\xff\xff\xff\xff\x0f not protobuf";  // a field longer than the
                                                // message
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), reply;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(20));
  std::promise<grpc::Status> done;
  generic.UnaryCall(&context, "/morse.v1.ParameterServer/Push",
                    grpc::StubOptions(), &request, &reply,
                    [&](grpc::Status status) { done.set_value(status); });
  const grpc::Status status = done.get_future().get();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_NE(status.error_message().find("not a PushRequest"), std::string::npos)
      << status.error_message();
  v1::ShardInfo after;
  ASSERT_TRUE(Info(&after).ok());
  EXPECT_EQ(after.mirror_checksum(), before_.mirror_checksum());
  EXPECT_EQ(after.completed_steps(), before_.completed_steps());
}

TEST_F(BadInputTest, UnknownRank) {
  ExpectRejected(Sign1Push(7), grpc::StatusCode::INVALID_ARGUMENT,
                 "unknown rank 7");
}

TEST_F(BadInputTest, UnknownPartition) {
  v1::PushRequest request = Sign1Push(0);
  request.set_partition(9);
  ExpectRejected(request, grpc::StatusCode::INVALID_ARGUMENT, "partition 9");
}

TEST_F(BadInputTest, LayoutFingerprintMismatch) {
  v1::PushRequest request = Sign1Push(0);
  request.set_layout_fingerprint(request.layout_fingerprint() ^ 1);
  ExpectRejected(request, grpc::StatusCode::FAILED_PRECONDITION, "layout");
}

TEST_F(BadInputTest, StepFromThePast) {
  ExpectRejected(Fp32Push(0, 0, 0), grpc::StatusCode::FAILED_PRECONDITION,
                 "stale");
}

TEST_F(BadInputTest, StepTooFarAhead) {
  v1::PushRequest request = Sign1Push(0);
  request.set_step(3);
  // ABORTED: a worker ahead of a restored shard replays from the step named
  // in the trailing metadata.
  ExpectRejected(request, grpc::StatusCode::ABORTED, "too far ahead");
}

TEST_F(BadInputTest, CodecNotAllowedInThisPhase) {
  ExpectRejected(Fp32Push(2, 0, 0), grpc::StatusCode::FAILED_PRECONDITION,
                 "not allowed at step 2");
}

TEST_F(BadInputTest, UnspecifiedCodec) {
  v1::PushRequest request = Sign1Push(0);
  request.set_codec(v1::CODEC_UNSPECIFIED);
  ExpectRejected(request, grpc::StatusCode::INVALID_ARGUMENT, "unknown codec");
}

TEST_F(BadInputTest, NonFiniteScale) {
  for (float bad : {NAN, INFINITY}) {
    v1::PushRequest request = Sign1Push(0);
    std::memcpy(request.mutable_payload()->data() + 4, &bad,
                4);  // block 1's scale
    ExpectRejected(request, grpc::StatusCode::INVALID_ARGUMENT,
                   "scale of block 1");
  }
}

TEST_F(BadInputTest, RetriedPushGetsTheSameReply) {
  // Step 1 completed in SetUp; rank 0 asks again with the same bytes.
  const auto first = Send(Fp32Push(1, 0, 0));
  const auto second = Send(Fp32Push(1, 0, 0));
  ASSERT_TRUE(first.first.ok()) << first.first.error_message();
  ASSERT_TRUE(second.first.ok());
  EXPECT_EQ(first.second.payload(), second.second.payload());
  EXPECT_EQ(first.second.step(), 1);
  v1::ShardInfo after;
  ASSERT_TRUE(Info(&after).ok());
  EXPECT_EQ(after.mirror_checksum(), before_.mirror_checksum());
}

TEST_F(BadInputTest, ResentWithDifferentBytes) {
  v1::PushRequest request = Fp32Push(1, 0, 0);
  (*request.mutable_payload())[0] ^= 1;
  ExpectRejected(request, grpc::StatusCode::FAILED_PRECONDITION,
                 "different bytes");
}

TEST_F(BadInputTest, AStepMissingAWorkerTimesOutWithAClearError) {
  // Only rank 0 pushes step 2; the recovery timeout is 2 s.
  const absl::Time start = absl::Now();
  const auto [status, reply] = Send(Sign1Push(0));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << status.error_message();
  EXPECT_NE(status.error_message().find("rank(s) 1 did not push"),
            std::string::npos)
      << status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The partial step was dropped: both ranks can now complete it.
  auto other =
      std::async(std::launch::async, [&] { return Send(Sign1Push(1)); });
  EXPECT_TRUE(Send(Sign1Push(0)).first.ok());
  EXPECT_TRUE(other.get().first.ok());
}

}  // namespace
}  // namespace morse
