#include "server/service.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace morse::server {

bool ParameterServerService::Authorized(grpc::CallbackServerContext* context,
                                        grpc::ServerUnaryReactor* reactor,
                                        std::optional<uint32_t> as_rank) {
  int64_t caller = proto::TokenFile::kAnyRank;
  grpc::Status status = proto::CheckBearerToken(*context, tokens_, &caller);
  if (status.ok() && as_rank.has_value())
    status = proto::CheckRank(caller, *as_rank);
  if (status.ok()) return true;
  if (metrics_ != nullptr) metrics_->Unauthenticated();
  reactor->Finish(status);
  return false;
}

grpc::ServerUnaryReactor* ParameterServerService::Finish(
    grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
    const absl::Status& status) {
  proto::AddTrailers(status, context);
  reactor->Finish(proto::ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::Join(
    grpc::CallbackServerContext* context, const v1::JoinRequest* request,
    v1::JoinReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  const absl::Status status = handler_.Join(*request, reply);
  if (metrics_ != nullptr) metrics_->SetWorkersJoined(reply->workers_joined());
  return Finish(context, reactor, status);
}

grpc::ServerUnaryReactor* ParameterServerService::InitPartition(
    grpc::CallbackServerContext* context,
    const v1::InitPartitionRequest* request, v1::InitPartitionReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  return Finish(context, reactor, handler_.InitPartition(*request, reply));
}

grpc::ByteBuffer SerializePushReply(std::shared_ptr<const Reply> reply) {
  // morse.proto's PushReply: step = 1, partition = 2, codec = 3 (varints),
  // payload = 4, buffers = 5 (length-delimited), grad_sum_of_squares = 6
  // (fixed64), absent = 7 (packed varints), grad_sum_abs = 8 (fixed64),
  // grad_max_abs = 9 (fixed32), piece_stats = 10 (packed doubles).
  using google::protobuf::io::CodedOutputStream;
  using google::protobuf::io::StringOutputStream;
  // Tags: field number << 3 | wire type (0 varint, 1 fixed64, 2
  // length-delimited, 5 fixed32).
  constexpr auto tag = [](uint32_t field, uint32_t type) {
    return field << 3 | type;
  };
  std::string head, tail;
  {
    StringOutputStream stream(&head);
    CodedOutputStream out(&stream);
    out.WriteTag(tag(1, 0));
    out.WriteVarint64(static_cast<uint64_t>(reply->step));
    out.WriteTag(tag(2, 0));
    out.WriteVarint32(reply->partition);
    out.WriteTag(tag(3, 0));
    out.WriteVarint32SignExtended(
        static_cast<int32_t>(proto::ToWire(reply->codec)));
    out.WriteTag(tag(4, 2));
    out.WriteVarint64(reply->payload.size());
  }
  {
    StringOutputStream stream(&tail);
    CodedOutputStream out(&stream);
    if (!reply->buffers.empty()) {
      out.WriteTag(tag(5, 2));
      out.WriteVarint64(reply->buffers.size());
      out.WriteRaw(reply->buffers.data(),
                   static_cast<int>(reply->buffers.size()));
    }
    if (reply->grad_sum_of_squares.has_value()) {
      uint64_t bits = 0;
      std::memcpy(&bits, &*reply->grad_sum_of_squares, sizeof bits);
      out.WriteTag(tag(6, 1));
      out.WriteLittleEndian64(bits);
    }
    if (!reply->absent.empty()) {  // packed
      size_t size = 0;
      for (uint32_t rank : reply->absent)
        size += CodedOutputStream::VarintSize32(rank);
      out.WriteTag(tag(7, 2));
      out.WriteVarint64(size);
      for (uint32_t rank : reply->absent) out.WriteVarint32(rank);
    }
    if (reply->grad_other_norms.has_value()) {
      uint64_t sum_bits = 0;
      std::memcpy(&sum_bits, &reply->grad_other_norms->sum_abs,
                  sizeof sum_bits);
      out.WriteTag(tag(8, 1));
      out.WriteLittleEndian64(sum_bits);
      uint32_t max_bits = 0;
      std::memcpy(&max_bits, &reply->grad_other_norms->max_abs,
                  sizeof max_bits);
      out.WriteTag(tag(9, 5));
      out.WriteLittleEndian32(max_bits);
    }
    if (!reply->piece_stats.empty()) {  // packed
      out.WriteTag(tag(10, 2));
      out.WriteVarint64(reply->piece_stats.size() * sizeof(double));
      for (double value : reply->piece_stats) {
        uint64_t bits = 0;
        std::memcpy(&bits, &value, sizeof bits);
        out.WriteLittleEndian64(bits);
      }
    }
  }
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  if (!reply->payload.empty()) {
    // The slice holds a reference to the reply; gRPC drops it when the
    // bytes are sent (the payload is never written through it).
    auto* owner = new std::shared_ptr<const Reply>(reply);
    slices.emplace_back(
        const_cast<char*>((*owner)->payload.data()), (*owner)->payload.size(),
        [](void* user_data) {
          delete static_cast<std::shared_ptr<const Reply>*>(user_data);
        },
        owner);
  }
  if (!tail.empty()) slices.emplace_back(tail);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ServerUnaryReactor* ParameterServerService::Push(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The push is here: the worker may upload its next one to this shard
  // (its transport uploads a shard's pushes in turn) while this one waits
  // for the other workers' pushes of its partition.
  reactor->StartSendInitialMetadata();
  v1::PushRequest request;
  if (!grpc::GenericDeserialize<grpc::ProtoBufferReader, v1::PushRequest>(
           const_cast<grpc::ByteBuffer*>(raw_request), &request)
           .ok()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "a push that is not a PushRequest"));
    return reactor;
  }
  if (!Authorized(context, reactor, request.rank())) return reactor;
  const size_t bytes_in = request.payload().size();
  const v1::Codec codec = request.codec();
  handler_.Push(
      request, [this, context, reactor, raw_reply, bytes_in,
                codec](absl::StatusOr<std::shared_ptr<const Reply>> result) {
        if (metrics_ != nullptr) {
          if (auto kind = proto::FromWire(codec); kind.ok()) {
            metrics_->Push(result.status().code(), *kind, bytes_in,
                           result.ok() ? (*result)->payload.size() : 0);
          }
        }
        if (result.ok()) {
          *raw_reply = SerializePushReply(*std::move(result));
        } else {
          proto::AddTrailers(result.status(), context);
        }
        reactor->Finish(proto::ToGrpc(result.status()));
      });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::FetchPartition(
    grpc::CallbackServerContext* context,
    const v1::FetchPartitionRequest* request, v1::PartitionState* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor)) return reactor;
  return Finish(context, reactor, handler_.FetchPartition(*request, reply));
}

grpc::ServerUnaryReactor* ParameterServerService::RestorePartition(
    grpc::CallbackServerContext* context, const v1::PartitionState* request,
    v1::RestorePartitionReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  return Finish(context, reactor, handler_.RestorePartition(*request));
}

grpc::ServerUnaryReactor* ParameterServerService::Abort(
    grpc::CallbackServerContext* context, const v1::AbortRequest* request,
    v1::AbortReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  return Finish(context, reactor, handler_.Abort(*request));
}

grpc::ServerUnaryReactor* ParameterServerService::Commit(
    grpc::CallbackServerContext* context, const v1::CommitRequest* request,
    v1::CommitReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  return Finish(context, reactor, handler_.Commit(*request));
}

grpc::ServerUnaryReactor* ParameterServerService::GetShardInfo(
    grpc::CallbackServerContext* context, const v1::ShardInfoRequest* request,
    v1::ShardInfo* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor)) return reactor;
  return Finish(context, reactor, handler_.GetShardInfo(*request, reply));
}

}  // namespace morse::server
