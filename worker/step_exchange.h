// StepExchange: one step's pipelined exchange with every shard (DESIGN 1):
// partitions encoded and pushed through a window, replies applied as they
// land. What is not simply answered (an unreachable shard, one restarted
// from its checkpoint: DESIGN 4) is its ShardRecovery's (shard_recovery.h),
// which it calls as each push leaves and as each answer lands. client.h
// says how it fits with the client's other calls.
#ifndef MORSE_WORKER_STEP_EXCHANGE_H_
#define MORSE_WORKER_STEP_EXCHANGE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "compress/clipping.h"
#include "compress/codec.h"
#include "compress/compute_pool.h"
#include "compress/layout.h"
#include "compress/simulator.h"
#include "compress/step_plan.h"
#include "compress/sync.h"
#include "worker/shard_recovery.h"

namespace morse::worker {

struct StepTraffic {
  uint64_t payload_up = 0;           // payload bytes pushed
  uint64_t payload_down = 0;         // payload bytes received
  double encode_seconds = 0;         // summed over the threads that encoded
  double encode_inline_seconds = 0;  // of which on the calling thread
  double apply_seconds = 0;          // summed over the threads that applied
  uint32_t retries = 0;
};

class PushClient;

// Partition `p`'s learning rate and weight decay among a step's `hypers`
// (one for the whole model, or one per segment of the layout), or null
// where the job's schedule sets them.
inline const compress::StepHyper* HyperOf(
    const std::vector<compress::StepHyper>& hypers,
    const compress::Partition& p) {
  return compress::HyperOf(hypers, p.segment);
}

// What every push of a step carries besides its payload.
struct StepExtras {
  // The step's learning rate and weight decay (Session::SetStepHyper: one,
  // one per segment of the layout, or none for the job's schedule).
  std::vector<compress::StepHyper> hyper;
  // Rank 0's module buffers, sent with its push of partition 0
  // (morse.proto); the reply's are in received_buffers() after Finish.
  std::string buffers;
  // The previous step's sum of squares of the averaged gradient, when that
  // step clipped it (morse.proto Commit).
  std::optional<double> previous_grad_sum_of_squares;
  // With it, when the workers chose that step's max_norm.
  std::optional<float> previous_clip_max_norm;
  // And their clip of part of the model, if any.
  compress::ClipPieces previous_clip_pieces;
  // onebit_lamb: the previous step's commit (morse.proto CommitRequest).
  std::vector<double> previous_commit;
  // The workers clip this step's averaged gradient by a max_norm they
  // commit after it (morse.proto PushRequest.workers_clip).
  bool workers_clip = false;
  // Step 0: the worker's x over the whole model, each partition's hash of
  // which its push carries (PushRequest.x_hash); empty at later steps.
  absl::Span<const float> x;
  // The previous step's gradient as the workers amended it (the whole
  // model; Session::AmendAt), each partition's part of which its push
  // carries (PushRequest.previous_amended); null when not amended.
  std::shared_ptr<const std::vector<float>> previous_amended;
};

// One step's exchange, sent partition by partition: Send waits for a slot
// in the window, then encodes the partition and pushes it, on the calling
// thread, or (parallel_encode, with the session's compute pool) queues it
// and goes on while the exchange's sender thread waits for the slot and a
// pool thread encodes and pushes it; its reply is applied when it lands, on
// the pool if there is one, else on a gRPC thread. Finish waits for every
// sent partition and for recovery's re-sends. Sends must come from one
// thread; the destructor waits for anything in flight.
// What a shard sends beside a reply's payload (morse.proto PushReply): the
// norms of its decoded values when the step clips the averaged gradient
// (compress::ClipsAverage, design.md 2.6): its sum of squares, and its
// norms of order 1 and infinity when the workers clip (a script's
// clip_grad_norm_ may take those); and the layer statistics of the
// partition's pieces (a layer rule's: onebit_lamb), taken on the shard's
// mirror (design.md 2.8).
struct ReplyExtras {
  std::optional<double> sum_of_squares;
  std::optional<compress::OtherNorms> other;
  std::vector<double> piece_stats;
};

class StepExchange final : private ExchangeSide {
 public:
  using Encode = std::function<absl::Status(const compress::Partition&,
                                            std::string* payload)>;
  using Apply =
      std::function<absl::Status(const compress::Partition&,
                                 const std::string& reply, ReplyExtras extras)>;

  // `pool` (null: none) encodes and applies partitions; it outlives the
  // exchange. `window`: partitions in flight at once (at least 1).
  // parallel_encode: `encode` may run on the pool, concurrently for
  // different partitions (the host engine; not a GPU's).
  StepExchange(PushClient* client, compress::ComputePool* pool, int64_t step,
               compress::CodecKind up, uint32_t window, Apply apply,
               StepExtras extras = {}, bool parallel_encode = false);
  ~StepExchange();
  StepExchange(const StepExchange&) = delete;
  StepExchange& operator=(const StepExchange&) = delete;

  // Returns the first error of the step so far (then nothing is sent).
  absl::Status Send(const compress::Partition& partition, const Encode& encode);
  absl::Status Finish(StepTraffic* traffic);
  // The module buffers that came with partition 0's reply (empty if none).
  std::string TakeReceivedBuffers();
  // The ranks each partition's reply left out of its average (membership,
  // design.md 4, "Membership"), for the partitions whose replies left some out.
  std::map<uint32_t, std::vector<uint32_t>> TakeAbsent();

 private:
  // ExchangeSide: what its recovery calls.
  void Issue(std::unique_ptr<PushCall> call) override;
  void Fail(const compress::Partition& partition, absl::Status status,
            bool ends_call) override;
  void OnDone(PushCall* raw, const absl::Status& status);
  // A reply (or final error) of this step's own push: applies it and
  // counts the partition done.
  void Deliver(std::unique_ptr<PushCall> done, const absl::Status& status);
  absl::Status EncodeAndIssue(std::unique_ptr<PushCall> call,
                              const Encode& encode, bool inline_call);

  PushClient* client_;
  compress::ComputePool* const pool_;
  const int64_t step_;
  const int wire_codec_;
  const uint32_t window_;
  const bool parallel_encode_;
  Apply apply_;
  StepExtras extras_;  // buffers are moved into partition 0's push
  Mutex mu_;
  std::string received_buffers_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, std::vector<uint32_t>> absent_ ABSL_GUARDED_BY(mu_);
  uint32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  StepTraffic traffic_ ABSL_GUARDED_BY(mu_);
  // With the compute pool (parallel_encode), Send queues the partition and
  // the sender thread waits for its slot in the window and hands it to the
  // pool, so that the caller (the training thread; backward()'s hooks on a
  // GPU) never waits for replies. Started by the first queued Send, ended
  // by the destructor once nothing is queued or in flight.
  struct Queued {
    std::unique_ptr<PushCall> call;
    Encode encode;
  };
  void SendQueued();
  // Await conditions: a slot in the window is free (or the step failed,
  // and nothing more is sent); nothing is queued or in flight.
  bool CanSend() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
  // Declared last: destroyed first, once its calls have ended.
  ShardRecovery recovery_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_STEP_EXCHANGE_H_
