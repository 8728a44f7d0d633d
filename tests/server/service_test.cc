// The Push reply on the wire (SerializePushReply): the bytes protobuf would
// write for the same PushReply, parsed back field for field, with the
// payload sent from the core's reply itself rather than a copy per worker.
#include "server/service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/wire.h"

namespace morse::server {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

v1::PushReply Parse(const grpc::ByteBuffer& buffer) {
  grpc::ByteBuffer copy(buffer);
  v1::PushReply parsed;
  EXPECT_TRUE((grpc::GenericDeserialize<grpc::ProtoBufferReader, v1::PushReply>(
                   &copy, &parsed)
                   .ok()));
  return parsed;
}

TEST(SerializePushReplyTest, IsTheProtobufEncodingOfTheSameReply) {
  for (const bool extras : {false, true}) {
    auto reply = std::make_shared<Reply>();
    reply->step = 123456789012;
    reply->partition = 70000;
    reply->codec = compress::CodecKind::kSign1;
    reply->payload = std::string(300000, '\0');
    for (size_t i = 0; i < reply->payload.size(); ++i)
      reply->payload[i] = static_cast<char>(i * 31);
    if (extras) {
      reply->buffers = "rank 0's buffers";
      reply->grad_sum_of_squares = 0.1 + 1e-17;
      reply->absent = {1, 200, 70000};  // varints of 1, 2 and 3 bytes
      reply->grad_other_norms = compress::OtherNorms{0.3 + 1e-16, 0.7f};
      reply->piece_stats = {0.1 + 1e-17, 2.5, -0.0, 1e300};
    }
    v1::PushReply expected;
    expected.set_step(reply->step);
    expected.set_partition(reply->partition);
    expected.set_codec(proto::ToWire(reply->codec));
    expected.set_payload(reply->payload);
    if (extras) {
      expected.set_buffers(reply->buffers);
      expected.set_grad_sum_of_squares(*reply->grad_sum_of_squares);
      for (uint32_t rank : reply->absent) expected.add_absent(rank);
      expected.set_grad_sum_abs(reply->grad_other_norms->sum_abs);
      expected.set_grad_max_abs(reply->grad_other_norms->max_abs);
      for (double value : reply->piece_stats) expected.add_piece_stats(value);
    }
    const grpc::ByteBuffer wire = SerializePushReply(reply);
    EXPECT_EQ(Flatten(wire), expected.SerializeAsString())
        << "extras " << extras;
    // The in-process transport's copy of the reply (tests/inproc) is the
    // same message.
    v1::PushReply message;
    ShardHandler::ToMessage(*reply, &message);
    EXPECT_EQ(message.SerializeAsString(), expected.SerializeAsString())
        << "extras " << extras;
    const v1::PushReply parsed = Parse(wire);
    EXPECT_EQ(parsed.step(), reply->step);
    EXPECT_EQ(parsed.partition(), reply->partition);
    EXPECT_EQ(parsed.codec(), proto::ToWire(reply->codec));
    EXPECT_EQ(parsed.payload(), reply->payload);
    EXPECT_EQ(parsed.buffers(), reply->buffers);
    EXPECT_EQ(parsed.has_grad_sum_of_squares(), extras);
    EXPECT_EQ(
        std::vector<uint32_t>(parsed.absent().begin(), parsed.absent().end()),
        reply->absent);
    if (extras) {
      const double got = parsed.grad_sum_of_squares();
      EXPECT_EQ(std::memcmp(&*reply->grad_sum_of_squares, &got, 8), 0);
      EXPECT_EQ(parsed.grad_sum_abs(), reply->grad_other_norms->sum_abs);
      EXPECT_EQ(parsed.grad_max_abs(), reply->grad_other_norms->max_abs);
    }
    const std::vector<double> pieces(parsed.piece_stats().begin(),
                                     parsed.piece_stats().end());
    ASSERT_EQ(pieces.size(), reply->piece_stats.size());
    if (!pieces.empty()) {  // memcmp takes no null pointers, even for 0 bytes
      EXPECT_EQ(std::memcmp(pieces.data(), reply->piece_stats.data(),
                            8 * pieces.size()),
                0);
    }
  }
}

TEST(SerializePushReplyTest, SendsThePayloadItselfAndKeepsItAlive) {
  auto reply = std::make_shared<Reply>();
  reply->payload = std::string(1 << 20, 'x');
  const char* payload = reply->payload.data();
  std::weak_ptr<const Reply> alive = reply;
  std::unique_ptr<grpc::ByteBuffer> wire;
  {
    auto first = std::make_unique<grpc::ByteBuffer>(SerializePushReply(reply));
    wire = std::make_unique<grpc::ByteBuffer>(
        SerializePushReply(reply));  // a second worker's
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(first->Dump(&slices).ok());
    bool shared = false;
    for (const grpc::Slice& s : slices)
      shared |= reinterpret_cast<const char*>(s.begin()) == payload;
    EXPECT_TRUE(shared) << "the payload was copied";
  }
  reply.reset();
  EXPECT_FALSE(alive.expired()) << "the second buffer still sends it";
  EXPECT_EQ(Parse(*wire).payload(), std::string(1 << 20, 'x'));
  wire.reset();
  EXPECT_TRUE(alive.expired());
}

}  // namespace
}  // namespace morse::server
