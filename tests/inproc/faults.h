// FaultyTransport: forwards every call to another Transport and, for
// pushes, injects the network's failures at the rates of a FaultPlan, in
// the manner of leveldb's FaultInjectionTestEnv: a push refused before it
// reaches the shard, its reply lost after the shard answered, a push
// delivered twice, one dropped without an answer (the caller's deadline
// ends it), and random delays that reorder pushes. Draws come from one
// seeded generator, so a plan is reproducible up to thread timing.
// Thread-safe.
#ifndef MORSE_TESTS_INPROC_FAULTS_H_
#define MORSE_TESTS_INPROC_FAULTS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "absl/time/time.h"
#include "compress/sync.h"
#include "worker/timer.h"
#include "worker/transport/transport.h"

namespace morse::inproc {

struct FaultPlan {
  double refuse = 0;  // UNAVAILABLE, not delivered
  double lose_reply =
      0;  // delivered; the caller gets UNAVAILABLE instead of the reply
  double duplicate = 0;  // delivered twice; the caller gets the first outcome
  double drop =
      0;  // not delivered, no answer: DEADLINE_EXCEEDED at the deadline
  absl::Duration max_delay =
      absl::ZeroDuration();  // each push waits up to this first
  // Every k-th GetShardInfo call is delivered and its caller gets
  // UNAVAILABLE, as when the connection is lost under the call (a GOAWAY);
  // 0: none.
  int lose_shard_info_every = 0;
  uint64_t seed = 1;

  std::string ToString() const;
};

class FaultyTransport final : public worker::Transport {
 public:
  FaultyTransport(std::unique_ptr<worker::Transport> inner, FaultPlan plan);
  ~FaultyTransport() override;

  uint32_t shards() const override { return inner_->shards(); }
  const std::string& address(uint32_t shard) const override {
    return inner_->address(shard);
  }

  void Join(uint32_t shard, const v1::JoinRequest& request,
            v1::JoinReply* reply, const worker::CallOptions& options,
            Done done) override {
    inner_->Join(shard, request, reply, options, std::move(done));
  }
  void InitPartition(uint32_t shard, const v1::InitPartitionRequest& request,
                     v1::InitPartitionReply* reply,
                     const worker::CallOptions& options, Done done) override {
    inner_->InitPartition(shard, request, reply, options, std::move(done));
  }
  void FetchPartition(uint32_t shard, const v1::FetchPartitionRequest& request,
                      v1::PartitionState* reply,
                      const worker::CallOptions& options, Done done) override {
    inner_->FetchPartition(shard, request, reply, options, std::move(done));
  }
  void RestorePartition(uint32_t shard, const v1::PartitionState& request,
                        v1::RestorePartitionReply* reply,
                        const worker::CallOptions& options,
                        Done done) override {
    inner_->RestorePartition(shard, request, reply, options, std::move(done));
  }
  void Abort(uint32_t shard, const v1::AbortRequest& request,
             v1::AbortReply* reply, const worker::CallOptions& options,
             Done done) override {
    inner_->Abort(shard, request, reply, options, std::move(done));
  }
  // Commits get the same faults as pushes (rank 0's Commit RPC after each
  // step of onebit_lamb or clipping).
  void Commit(uint32_t shard, const v1::CommitRequest& request,
              v1::CommitReply* reply, const worker::CallOptions& options,
              Done done) override {
    Inject(&Transport::Commit, shard, request, reply, options, std::move(done));
  }
  void GetShardInfo(uint32_t shard, const v1::ShardInfoRequest& request,
                    v1::ShardInfo* reply, const worker::CallOptions& options,
                    Done done) override;
  void Push(uint32_t shard, const v1::PushRequest& request,
            v1::PushReply* reply, const worker::CallOptions& options,
            Done done) override {
    Inject(&Transport::Push, shard, request, reply, options, std::move(done));
  }

  // Faults injected so far, of every kind together.
  uint64_t injected() const { return injected_.load(); }

 private:
  enum class Fault { kNone, kRefuse, kLoseReply, kDuplicate, kDrop };
  Fault Draw(absl::Duration* delay);
  // `call` (&Transport::Push or ::Commit) after the drawn delay, with the
  // drawn fault.
  template <typename Request, typename Reply>
  using Call = void (worker::Transport::*)(uint32_t, const Request&, Reply*,
                                           const worker::CallOptions&, Done);
  template <typename Request, typename Reply>
  void Inject(Call<Request, Reply> call, uint32_t shard, const Request& request,
              Reply* reply, const worker::CallOptions& options, Done done);
  template <typename Request, typename Reply>
  void Send(Call<Request, Reply> call, uint32_t shard, const Request& request,
            Reply* reply, const worker::CallOptions& options, Done done,
            Fault fault);

  std::unique_ptr<worker::Transport> inner_;
  const FaultPlan plan_;
  Mutex mu_;
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> injected_{0};
  std::atomic<uint64_t> shard_info_calls_{0};
  // Delivered duplicates' calls still in flight (the destructor waits).
  std::atomic<int> duplicates_{0};
  worker::Timer timer_;  // delays and drops
};

}  // namespace morse::inproc

#endif  // MORSE_TESTS_INPROC_FAULTS_H_
