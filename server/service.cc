#include "server/service.h"

#include "proto/wire.h"

namespace morse::server {

grpc::ServerUnaryReactor* ParameterServerService::InitPartition(
    grpc::CallbackServerContext* context, const v1::InitPartitionRequest* request,
    v1::InitPartitionReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = core_->InitPartition(request->rank(), request->partition(),
                                             request->layout_fingerprint(), request->values());
  const ShardStatus s = core_->Status();
  reply->set_partitions_initialized(s.partitions_initialized);
  reply->set_partitions_total(s.partitions);
  reactor->Finish(proto::ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::Push(grpc::CallbackServerContext* context,
                                                       const v1::PushRequest* request,
                                                       v1::PushReply* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto codec = proto::FromWire(request->codec());
  if (!codec.ok()) {
    reactor->Finish(proto::ToGrpc(codec.status()));
    return reactor;
  }
  PushArgs args;
  args.step = request->step();
  args.rank = request->rank();
  args.partition = request->partition();
  args.layout_fingerprint = request->layout_fingerprint();
  args.codec = *codec;
  args.payload = request->payload();
  core_->Push(std::move(args),
              [reactor, reply](absl::StatusOr<std::shared_ptr<const Reply>> result) {
                if (result.ok()) {
                  reply->set_step((*result)->step);
                  reply->set_partition((*result)->partition);
                  reply->set_codec(proto::ToWire((*result)->codec));
                  reply->set_payload((*result)->payload);
                }
                reactor->Finish(proto::ToGrpc(result.status()));
              });
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::FetchPartition(
    grpc::CallbackServerContext* context, const v1::FetchPartitionRequest* request,
    v1::PartitionState* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto snapshot = core_->FetchPartition(request->partition(), request->layout_fingerprint());
  if (snapshot.ok()) {
    const auto bytes = [](const std::vector<float>& a) {
      return std::string(reinterpret_cast<const char*>(a.data()), 4 * a.size());
    };
    reply->set_partition(request->partition());
    reply->set_completed_steps(snapshot->completed_steps);
    reply->set_x(bytes(snapshot->x));
    reply->set_m(bytes(snapshot->m));
    reply->set_v(bytes(snapshot->v));
  }
  reactor->Finish(proto::ToGrpc(snapshot.status()));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterServerService::GetShardInfo(
    grpc::CallbackServerContext* context, const v1::ShardInfoRequest*,
    v1::ShardInfo* reply) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const ShardStatus s = core_->Status();
  reply->set_shard(s.shard);
  reply->set_shards(core_->layout().spec().shards);
  reply->set_workers(s.workers);
  reply->set_layout_fingerprint(s.layout_fingerprint);
  reply->set_initialized(s.partitions_initialized == s.partitions);
  reply->set_completed_steps(s.completed_steps);
  reply->set_mirror_checksum(s.mirror_checksum);
  reply->set_range_begin(s.range.begin);
  reply->set_range_end(s.range.end);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace morse::server
