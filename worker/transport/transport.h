// Transport: how a worker's calls reach the job's shards — the seam between
// the client's step logic (worker/client.h: windows, retries, replays) and
// the wire. The gRPC implementation (grpc/transport.h) is what the daemons
// and morse.torch use; the tests' in-process one (tests/inproc) calls each
// shard's ShardHandler directly, and a forwarding wrapper there injects
// faults, in the manner of leveldb's EnvWrapper.
//
// Every call is asynchronous: `done` runs exactly once, with the outcome as
// an absl::Status whose payloads carry what the shard said besides
// (proto/wire.h: the step a partition accepts, "join again", "the step
// expired"), on a thread of the transport's — or before the call returns.
// The request and reply must stay alive until `done` runs; the reply is
// filled only when the status is OK. Thread-safe.
#ifndef MORSE_WORKER_TRANSPORT_TRANSPORT_H_
#define MORSE_WORKER_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "compress/sync.h"
#include "proto/morse.pb.h"

namespace morse::worker {

struct CallOptions {
  // The call fails with DEADLINE_EXCEEDED (and no payloads) this long after
  // it starts.
  double timeout_seconds = 10;
  // Calls with different lanes may travel over different connections
  // (gRPC: the shard's channel `lane % channels_per_shard`).
  uint32_t lane = 0;
  // Wait for the shard to accept a connection, up to the deadline, instead
  // of failing at once with UNAVAILABLE.
  bool wait_for_ready = false;
};

class Transport {
 public:
  using Done = std::function<void(absl::Status)>;

  virtual ~Transport() = default;

  // The job's shards, and how to name shard s in messages (host:port).
  virtual uint32_t shards() const = 0;
  virtual const std::string& address(uint32_t shard) const = 0;

  virtual void Join(uint32_t shard, const v1::JoinRequest& request,
                    v1::JoinReply* reply, const CallOptions& options,
                    Done done) = 0;
  virtual void InitPartition(uint32_t shard,
                             const v1::InitPartitionRequest& request,
                             v1::InitPartitionReply* reply,
                             const CallOptions& options, Done done) = 0;
  virtual void Push(uint32_t shard, const v1::PushRequest& request,
                    v1::PushReply* reply, const CallOptions& options,
                    Done done) = 0;
  virtual void FetchPartition(uint32_t shard,
                              const v1::FetchPartitionRequest& request,
                              v1::PartitionState* reply,
                              const CallOptions& options, Done done) = 0;
  virtual void RestorePartition(uint32_t shard,
                                const v1::PartitionState& request,
                                v1::RestorePartitionReply* reply,
                                const CallOptions& options, Done done) = 0;
  virtual void Abort(uint32_t shard, const v1::AbortRequest& request,
                     v1::AbortReply* reply, const CallOptions& options,
                     Done done) = 0;
  virtual void Commit(uint32_t shard, const v1::CommitRequest& request,
                      v1::CommitReply* reply, const CallOptions& options,
                      Done done) = 0;
  virtual void GetShardInfo(uint32_t shard, const v1::ShardInfoRequest& request,
                            v1::ShardInfo* reply, const CallOptions& options,
                            Done done) = 0;
};

// One call made synchronously: Wait(&Transport::Join, transport, shard,
// request, &reply, options) returns its status.
template <typename Request, typename Reply>
absl::Status Wait(void (Transport::*call)(uint32_t, const Request&, Reply*,
                                          const CallOptions&, Transport::Done),
                  Transport& transport, uint32_t shard, const Request& request,
                  Reply* reply, const CallOptions& options) {
  Notification finished;
  absl::Status result;
  (transport.*call)(shard, request, reply, options, [&](absl::Status status) {
    result = std::move(status);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

}  // namespace morse::worker

#endif  // MORSE_WORKER_TRANSPORT_TRANSPORT_H_
