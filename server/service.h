// The gRPC face of a shard: checks each call's bearer token, counts it in
// the metrics and hands it to the ShardHandler (handler.h), which
// translates morse.v1 messages to and from the core's plain types; the
// handler's status payloads go out as trailing metadata (callback API, one
// reactor per call).
// Push is a raw method: its reply goes out as slices over the core's reply,
// which is the same for every worker, so no worker's copy of it is made
// (SerializePushReply).
#ifndef MORSE_SERVER_SERVICE_H_
#define MORSE_SERVER_SERVICE_H_

#include <grpcpp/support/byte_buffer.h>

#include <memory>
#include <optional>

#include "proto/morse.grpc.pb.h"
#include "proto/security.h"
#include "server/handler.h"
#include "server/metrics.h"
#include "server/shard_host.h"

namespace morse::server {

// The PushReply of `reply` in protobuf's wire format without copying its
// payload: the fields before it, a slice over the payload that keeps
// `reply` alive until gRPC is done with it, then the fields after it.
grpc::ByteBuffer SerializePushReply(std::shared_ptr<const Reply> reply);

class ParameterServerService final
    : public v1::ParameterServer::WithRawCallbackMethod_Push<
          v1::ParameterServer::CallbackService> {
 public:
  // `metrics` may be null (no --metrics_listen); `tokens` null when calls
  // need no bearer token (no --token_file).
  ParameterServerService(ShardHost* host, ServerMetrics* metrics,
                         proto::TokenFile* tokens)
      : handler_(host), metrics_(metrics), tokens_(tokens) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinReply* reply) override;
  grpc::ServerUnaryReactor* InitPartition(
      grpc::CallbackServerContext* context,
      const v1::InitPartitionRequest* request,
      v1::InitPartitionReply* reply) override;
  // A PushRequest in, a PushReply out (SerializePushReply); INVALID_ARGUMENT
  // for bytes that are not a PushRequest.
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* raw_request,
                                 grpc::ByteBuffer* raw_reply) override;
  grpc::ServerUnaryReactor* FetchPartition(
      grpc::CallbackServerContext* context,
      const v1::FetchPartitionRequest* request,
      v1::PartitionState* reply) override;
  grpc::ServerUnaryReactor* RestorePartition(
      grpc::CallbackServerContext* context, const v1::PartitionState* request,
      v1::RestorePartitionReply* reply) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortReply* reply) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* context,
                                   const v1::CommitRequest* request,
                                   v1::CommitReply* reply) override;
  grpc::ServerUnaryReactor* GetShardInfo(grpc::CallbackServerContext* context,
                                         const v1::ShardInfoRequest* request,
                                         v1::ShardInfo* reply) override;

 private:
  // Finishes the call with `status` and its payloads as trailing metadata.
  // (A call's DefaultReactor() may be taken once only: gRPC builds it anew
  // on every call of it.)
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                   grpc::ServerUnaryReactor* reactor,
                                   const absl::Status& status);
  // Checks the bearer token (UNAUTHENTICATED without an accepted one); with
  // `as_rank`, also that a per-rank token is that rank's (PERMISSION_DENIED
  // otherwise). Finishes the call on failure.
  bool Authorized(grpc::CallbackServerContext* context,
                  grpc::ServerUnaryReactor* reactor,
                  std::optional<uint32_t> as_rank = std::nullopt);

  ShardHandler handler_;
  ServerMetrics* metrics_;
  proto::TokenFile* tokens_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_SERVICE_H_
