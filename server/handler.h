// ShardHandler: a shard's calls as morse.v1 messages in and out, over its
// ShardHost and ShardCore, whatever carries them. The gRPC service
// (service.h) adds the bearer-token check, metrics and the wire; the tests'
// in-process transport (tests/inproc) calls the handler directly, so N
// workers and S shards run in one process on the same translation.
//
// Outcomes are absl::Status values; what a shard tells a worker besides
// (the step a partition accepts, "join again", "the step expired") rides
// on them as payloads (proto/wire.h), which the service turns into
// trailing metadata.
//
// Thread-safe, as ShardHost and ShardCore are. Push's `done` runs as
// ShardCore::Push's does: maybe before Push returns, maybe on another
// thread.
#ifndef MORSE_SERVER_HANDLER_H_
#define MORSE_SERVER_HANDLER_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "proto/morse.pb.h"
#include "server/shard_host.h"

namespace morse::server {

class ShardHandler {
 public:
  explicit ShardHandler(ShardHost* host) : host_(host) {}
  ShardHandler(const ShardHandler&) = delete;
  ShardHandler& operator=(const ShardHandler&) = delete;

  // Each fills `reply` (which the caller owns) and returns the outcome.
  // Calls that need the model's size fail with UNAVAILABLE and the
  // kNeedsJoinKey payload while no worker has joined an external job.
  absl::Status Join(const v1::JoinRequest& request, v1::JoinReply* reply);
  absl::Status InitPartition(const v1::InitPartitionRequest& request,
                             v1::InitPartitionReply* reply);
  absl::Status FetchPartition(const v1::FetchPartitionRequest& request,
                              v1::PartitionState* reply);
  absl::Status RestorePartition(const v1::PartitionState& request);
  absl::Status Abort(const v1::AbortRequest& request);
  absl::Status Commit(const v1::CommitRequest& request);
  absl::Status GetShardInfo(const v1::ShardInfoRequest& request,
                            v1::ShardInfo* reply);

  // Hands the push to the core (its payload moved out of `request`); `done`
  // gets the reply every worker of the step shares, or the error, exactly
  // once. Malformed requests fail with INVALID_ARGUMENT before the core
  // sees them.
  using PushDone =
      std::function<void(absl::StatusOr<std::shared_ptr<const Reply>>)>;
  void Push(v1::PushRequest& request, PushDone done);

  // The reply as a PushReply message (a copy of its payload; the gRPC
  // service sends the bytes without one: SerializePushReply).
  static void ToMessage(const Reply& reply, v1::PushReply* message);

  ShardHost* host() const { return host_; }

 private:
  // The core, or UNAVAILABLE with kNeedsJoinKey while there is none.
  absl::StatusOr<std::shared_ptr<ShardCore>> Core() const;

  ShardHost* host_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_HANDLER_H_
