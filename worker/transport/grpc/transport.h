// GrpcTransport: the Transport of the daemons and morse.torch — gRPC
// channels to every shard (`channels_per_shard` each, separate TCP
// connections, a call's lane choosing one), with the credentials of
// proto/security.h and this rank's bearer token on every call. Trailing
// metadata comes back as the status's payloads (proto/wire.h). `done` runs
// on gRPC's callback threads. Thread-safe.
#ifndef MORSE_WORKER_TRANSPORT_GRPC_TRANSPORT_H_
#define MORSE_WORKER_TRANSPORT_GRPC_TRANSPORT_H_

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job_config.h"
#include "proto/morse.grpc.pb.h"
#include "proto/security.h"
#include "worker/transport/transport.h"

namespace morse::worker {

class GrpcTransport final : public Transport {
 public:
  // `servers[s]` is shard s's host:port. INVALID_ARGUMENT for a server list
  // that is not one per shard, a rank outside the job, or credentials that
  // break the policy of proto/security.h or the token file cannot be read;
  // connects lazily.
  static absl::StatusOr<std::unique_ptr<GrpcTransport>> Create(
      const proto::JobSpec& job, std::vector<std::string> servers,
      uint32_t rank, const proto::SecurityOptions& security);

  // Waits until every push it was given has ended (each has a deadline).
  ~GrpcTransport() override;

  uint32_t shards() const override {
    return static_cast<uint32_t>(servers_.size());
  }
  const std::string& address(uint32_t shard) const override {
    return servers_[shard];
  }

  void Join(uint32_t shard, const v1::JoinRequest& request,
            v1::JoinReply* reply, const CallOptions& options,
            Done done) override;
  void InitPartition(uint32_t shard, const v1::InitPartitionRequest& request,
                     v1::InitPartitionReply* reply, const CallOptions& options,
                     Done done) override;
  void Push(uint32_t shard, const v1::PushRequest& request,
            v1::PushReply* reply, const CallOptions& options,
            Done done) override;
  void FetchPartition(uint32_t shard, const v1::FetchPartitionRequest& request,
                      v1::PartitionState* reply, const CallOptions& options,
                      Done done) override;
  void RestorePartition(uint32_t shard, const v1::PartitionState& request,
                        v1::RestorePartitionReply* reply,
                        const CallOptions& options, Done done) override;
  void Abort(uint32_t shard, const v1::AbortRequest& request,
             v1::AbortReply* reply, const CallOptions& options,
             Done done) override;
  void Commit(uint32_t shard, const v1::CommitRequest& request,
              v1::CommitReply* reply, const CallOptions& options,
              Done done) override;
  void GetShardInfo(uint32_t shard, const v1::ShardInfoRequest& request,
                    v1::ShardInfo* reply, const CallOptions& options,
                    Done done) override;

 private:
  GrpcTransport(const proto::JobSpec& job, std::vector<std::string> servers,
                const proto::SecurityOptions& security,
                std::unique_ptr<proto::TokenFile> tokens);
  // A call's deadline: options.timeout_seconds from now.
  static std::chrono::system_clock::time_point Deadline(
      const CallOptions& options);
  // Sets up `context` (the deadline, wait_for_ready, this rank's token) and
  // returns the stub of shard s's channel for options.lane.
  v1::ParameterServer::Stub::async_interface* Prepare(
      grpc::ClientContext* context, uint32_t shard,
      std::chrono::system_clock::time_point deadline,
      const CallOptions& options) const;
  // Starts `method` of shard s's stub for `lane` with a fresh context (the
  // deadline, the token) that lives until `done` has run.
  template <typename Request, typename Reply, typename Method>
  void Start(uint32_t shard, Method method, const Request& request,
             Reply* reply, const CallOptions& options, Done done);

  // A shard's pushes upload in turn: at most uploads_per_shard_ of them are
  // on their way to it at once, the rest wait here in the order they came.
  // A push is on its way until the shard says it has it (its initial
  // metadata, which the shard sends as a push arrives) or it ends.
  class PushCall;
  struct Uploads {
    Mutex mu;
    uint32_t sending ABSL_GUARDED_BY(mu) = 0;
    std::deque<std::function<void()>> waiting ABSL_GUARDED_BY(mu);
  };
  void StartPush(uint32_t shard, const v1::PushRequest& request,
                 v1::PushReply* reply, const CallOptions& options,
                 std::chrono::system_clock::time_point deadline, Done done);
  // Push `shard`'s next waiting push, or free its place.
  void Uploaded(uint32_t shard);

  std::vector<std::string> servers_;
  std::unique_ptr<proto::TokenFile> tokens_;
  // stubs_[shard][channel]
  std::vector<std::vector<std::unique_ptr<v1::ParameterServer::Stub>>> stubs_;
  uint32_t uploads_per_shard_;                     // 0: no limit
  std::vector<std::unique_ptr<Uploads>> uploads_;  // by shard
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_TRANSPORT_GRPC_TRANSPORT_H_
