#include "server/service.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace morse::server {

ShardCore* ParameterServerService::CoreOrFinish(grpc::CallbackServerContext* context,
                                                grpc::ServerUnaryReactor* reactor) {
  ShardCore* core = host_->core();
  if (core == nullptr) {
    // An external job's shard that restarted: the workers Join again.
    context->AddTrailingMetadata(proto::kNeedsJoinKey, "1");
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the model's size is not known yet: no worker has joined"));
  }
  return core;
}

bool ParameterServerService::Authorized(grpc::CallbackServerContext* context,
                                        grpc::ServerUnaryReactor* reactor,
                                        std::optional<uint32_t> as_rank) {
  int64_t caller = proto::TokenFile::kAnyRank;
  grpc::Status status = proto::CheckBearerToken(*context, tokens_, &caller);
  if (status.ok() && as_rank.has_value()) status = proto::CheckRank(caller, *as_rank);
  if (status.ok()) return true;
  if (metrics_ != nullptr) metrics_->Unauthenticated();
  reactor->Finish(status);
  return false;
}

grpc::ServerUnaryReactor* ParameterServerService::Join(grpc::CallbackServerContext* context,
                                                       const v1::JoinRequest* request,
                                                       v1::JoinReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  auto job = proto::ParseJobConfigProto(request->job().SerializeAsString());
  absl::Status status = job.ok() ? host_->Join(request->rank(), *job) : job.status();
  reply->set_workers_joined(host_->workers_joined());
  reply->set_workers(host_->base().workers());
  if (metrics_ != nullptr) metrics_->SetWorkersJoined(host_->workers_joined());
  if (ShardCore* core = host_->core()) reply->set_layout_fingerprint(core->layout().fingerprint());
  reactor->Finish(proto::ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::InitPartition(
    grpc::CallbackServerContext* context, const v1::InitPartitionRequest* request,
    v1::InitPartitionReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  absl::Status status = core->InitPartition(request->rank(), request->partition(),
                                             request->layout_fingerprint(), request->values());
  const ShardStatus s = core->Status();
  reply->set_partitions_initialized(s.partitions_initialized);
  reply->set_partitions_total(s.partitions);
  reactor->Finish(proto::ToGrpc(status));
  return reactor;
}

grpc::ByteBuffer SerializePushReply(std::shared_ptr<const Reply> reply) {
  // morse.proto's PushReply: step = 1, partition = 2, codec = 3 (varints),
  // payload = 4, buffers = 5 (length-delimited), grad_sum_of_squares = 6
  // (fixed64).
  using google::protobuf::io::CodedOutputStream;
  using google::protobuf::io::StringOutputStream;
  // Tags: field number << 3 | wire type (0 varint, 1 fixed64, 2 length-delimited).
  constexpr auto tag = [](uint32_t field, uint32_t type) { return field << 3 | type; };
  std::string head, tail;
  {
    StringOutputStream stream(&head);
    CodedOutputStream out(&stream);
    out.WriteTag(tag(1, 0));
    out.WriteVarint64(static_cast<uint64_t>(reply->step));
    out.WriteTag(tag(2, 0));
    out.WriteVarint32(reply->partition);
    out.WriteTag(tag(3, 0));
    out.WriteVarint32SignExtended(static_cast<int32_t>(proto::ToWire(reply->codec)));
    out.WriteTag(tag(4, 2));
    out.WriteVarint64(reply->payload.size());
  }
  {
    StringOutputStream stream(&tail);
    CodedOutputStream out(&stream);
    if (!reply->buffers.empty()) {
      out.WriteTag(tag(5, 2));
      out.WriteVarint64(reply->buffers.size());
      out.WriteRaw(reply->buffers.data(), static_cast<int>(reply->buffers.size()));
    }
    if (reply->grad_sum_of_squares.has_value()) {
      uint64_t bits = 0;
      std::memcpy(&bits, &*reply->grad_sum_of_squares, sizeof bits);
      out.WriteTag(tag(6, 1));
      out.WriteLittleEndian64(bits);
    }
  }
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  if (!reply->payload.empty()) {
    // The slice holds a reference to the reply; gRPC drops it when the
    // bytes are sent (the payload is never written through it).
    auto* owner = new std::shared_ptr<const Reply>(reply);
    slices.emplace_back(const_cast<char*>((*owner)->payload.data()), (*owner)->payload.size(),
                        [](void* user_data) { delete static_cast<std::shared_ptr<const Reply>*>(user_data); },
                        owner);
  }
  if (!tail.empty()) slices.emplace_back(tail);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ServerUnaryReactor* ParameterServerService::Push(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* raw_request,
                                                       grpc::ByteBuffer* raw_reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::PushRequest request;
  if (!grpc::GenericDeserialize<grpc::ProtoBufferReader, v1::PushRequest>(
           const_cast<grpc::ByteBuffer*>(raw_request), &request)
           .ok()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a push that is not a PushRequest"));
    return reactor;
  }
  if (!Authorized(context, reactor, request.rank())) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  auto codec = proto::FromWire(request.codec());
  if (!codec.ok()) {
    reactor->Finish(proto::ToGrpc(codec.status()));
    return reactor;
  }
  PushArgs args;
  args.step = request.step();
  args.rank = request.rank();
  args.partition = request.partition();
  args.layout_fingerprint = request.layout_fingerprint();
  args.codec = *codec;
  // The request is this call's own, and nothing reads its payload after
  // this: take the bytes instead of copying them (1 MiB per partition in
  // fp32 phases).
  const size_t bytes_in = request.payload().size();
  args.payload.swap(*request.mutable_payload());
  args.buffers = request.buffers();
  if (request.has_lr() != request.has_weight_decay()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "a push sets lr and weight_decay together or neither"));
    return reactor;
  }
  if (request.has_lr()) {
    args.hyper = compress::StepHyper{request.lr(), request.weight_decay()};
  }
  args.previous_lamb_commit.assign(request.previous_lamb_commit().begin(),
                                   request.previous_lamb_commit().end());
  if (request.has_previous_grad_sum_of_squares()) {
    args.previous_grad_sum_of_squares = request.previous_grad_sum_of_squares();
  }
  const compress::CodecKind kind = *codec;
  core->Push(std::move(args),
              [this, context, reactor, raw_reply, bytes_in, kind](
                  absl::StatusOr<std::shared_ptr<const Reply>> result) {
                if (metrics_ != nullptr) {
                  metrics_->Push(result.status().code(), kind, bytes_in,
                                 result.ok() ? (*result)->payload.size() : 0);
                }
                if (result.ok()) {
                  *raw_reply = SerializePushReply(*std::move(result));
                } else if (auto next = result.status().GetPayload(kNextStepPayload)) {
                  context->AddTrailingMetadata(proto::kNextStepKey, std::string(*next));
                } else if (result.status().code() == absl::StatusCode::kDeadlineExceeded) {
                  // The shard gave up on the step: not worth a retry.
                  context->AddTrailingMetadata(proto::kStepExpiredKey, "1");
                }
                reactor->Finish(proto::ToGrpc(result.status()));
              });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::FetchPartition(
    grpc::CallbackServerContext* context, const v1::FetchPartitionRequest* request,
    v1::PartitionState* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor)) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  auto snapshot = core->FetchPartition(request->partition(), request->layout_fingerprint(),
                                       request->server_error());
  if (snapshot.ok()) {
    const auto bytes = [](const std::vector<float>& a) {
      return std::string(reinterpret_cast<const char*>(a.data()), 4 * a.size());
    };
    reply->set_partition(request->partition());
    reply->set_completed_steps(snapshot->completed_steps);
    if (!request->skip_model()) {
      reply->set_x(bytes(snapshot->x));
      reply->set_m(bytes(snapshot->m));
      reply->set_v(bytes(snapshot->v));
      reply->set_v_fresh(bytes(snapshot->v_fresh));
      reply->mutable_lamb_layers()->Assign(snapshot->lamb_layers.begin(), snapshot->lamb_layers.end());
    }
    if (request->server_error()) reply->set_server_error(bytes(snapshot->server_error));
  }
  reactor->Finish(proto::ToGrpc(snapshot.status()));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::RestorePartition(
    grpc::CallbackServerContext* context, const v1::PartitionState* request,
    v1::RestorePartitionReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  PartitionSnapshot state;
  state.completed_steps = request->completed_steps();
  absl::Status status;
  const auto floats = [&status](const std::string& bytes, const char* what, std::vector<float>* out) {
    if (bytes.size() % 4 != 0) {
      if (status.ok()) {
        status = absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes.size(),
                                                         " bytes is not a whole number of fp32"));
      }
      return;
    }
    out->resize(bytes.size() / 4);
    std::memcpy(out->data(), bytes.data(), bytes.size());
  };
  floats(request->x(), "x", &state.x);
  floats(request->m(), "m", &state.m);
  floats(request->v(), "v", &state.v);
  floats(request->server_error(), "server_error", &state.server_error);
  if (status.ok()) {
    status = core->RestorePartition(request->rank(), request->partition(),
                                    request->layout_fingerprint(), state);
  }
  reactor->Finish(proto::ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::Abort(grpc::CallbackServerContext* context,
                                                        const v1::AbortRequest* request,
                                                        v1::AbortReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  reactor->Finish(proto::ToGrpc(core->Abort(request->rank(), request->step(),
                                            request->layout_fingerprint(), request->reason())));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::Commit(grpc::CallbackServerContext* context,
                                                         const v1::CommitRequest* request,
                                                         v1::CommitReply*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor, request->rank())) return reactor;
  ShardCore* core = CoreOrFinish(context, reactor);
  if (core == nullptr) return reactor;
  if (request->lamb_commit_size() > 0) {
    reactor->Finish(proto::ToGrpc(core->CommitLamb(
        request->rank(), request->step(), request->layout_fingerprint(),
        std::vector<double>(request->lamb_commit().begin(), request->lamb_commit().end()))));
    return reactor;
  }
  reactor->Finish(proto::ToGrpc(core->Commit(request->rank(), request->step(),
                                             request->layout_fingerprint(),
                                             request->grad_sum_of_squares())));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::GetShardInfo(
    grpc::CallbackServerContext* context, const v1::ShardInfoRequest* request,
    v1::ShardInfo* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!Authorized(context, reactor)) return reactor;
  reply->set_shard(host_->shard());
  reply->set_shards(host_->base().shards());
  reply->set_workers(host_->base().workers());
  reply->set_workers_joined(host_->workers_joined());
  ShardCore* core = host_->core();
  reply->set_configured(core != nullptr);
  if (core == nullptr) {
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  const ShardStatus s = core->Status();
  reply->set_layout_fingerprint(s.layout_fingerprint);
  reply->set_initialized(s.partitions_initialized == s.partitions);
  reply->set_completed_steps(s.completed_steps);
  reply->set_replies_kept_from(s.replies_kept_from);
  if (request->mirror_checksum()) reply->set_mirror_checksum(core->MirrorChecksum());
  reply->set_range_begin(s.range.begin);
  reply->set_range_end(s.range.end);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace morse::server
