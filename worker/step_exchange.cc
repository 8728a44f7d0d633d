#include "worker/step_exchange.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "compress/bytes_hash.h"
#include "compress/sync.h"
#include "compress/trace.h"
#include "proto/wire.h"
#include "worker/client.h"
#include "worker/rpc_status.h"

namespace morse::worker {

StepExchange::StepExchange(PushClient* client, compress::ComputePool* pool,
                           int64_t step, compress::CodecKind up,
                           uint32_t window, Apply apply, StepExtras extras,
                           bool parallel_encode)
    : client_(client),
      pool_(pool),
      step_(step),
      wire_codec_(proto::ToWire(up)),
      window_(std::max<uint32_t>(1, window)),
      parallel_encode_(parallel_encode),
      apply_(std::move(apply)),
      extras_(std::move(extras)),
      recovery_(client, step, this) {}

std::string StepExchange::TakeReceivedBuffers() {
  MutexLock lock(&mu_);
  return std::move(received_buffers_);
}

std::map<uint32_t, std::vector<uint32_t>> StepExchange::TakeAbsent() {
  MutexLock lock(&mu_);
  return std::move(absent_);
}

StepExchange::~StepExchange() {
  {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StepExchange::Idle));
    closing_ = true;
  }
  if (sender_.joinable()) sender_.join();
  recovery_.Wait();
}

bool StepExchange::CanSend() const {
  return in_flight_ < window_ || !error_.ok();
}

bool StepExchange::Idle() const { return in_flight_ == 0 && queue_.empty(); }

void StepExchange::SendQueued() {
  for (;;) {
    Queued next;
    {
      MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepExchange* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return self->closing_ || (!self->queue_.empty() && self->CanSend());
          },
          this));
      if (queue_.empty()) return;  // closing
      if (!error_.ok()) {          // the step failed: nothing more is sent
        queue_.clear();
        continue;
      }
      next = std::move(queue_.front());
      queue_.pop_front();
      ++in_flight_;
      recovery_.Sending(next.call->partition->id);
    }
    pool_->Schedule([this, call = std::move(next.call),
                     encode = std::move(next.encode)]() mutable {
      (void)EncodeAndIssue(std::move(call), encode, /*inline_call=*/false);
    });
  }
}

void StepExchange::Issue(std::unique_ptr<PushCall> call) {
  ++call->attempt;
  if (trace::Enabled()) call->issued_us = trace::NowMicros();
  // The completion owns the call and destroys it before it signals the
  // step: once Finish() returns, nothing of this step is left in flight.
  PushCall* raw = call.release();
  client_->transport_->Push(
      raw->partition->shard, raw->request, &raw->reply,
      client_->Options(client_->job_.rpc_timeout_seconds, raw->partition->id),
      [this, raw](absl::Status status) { OnDone(raw, std::move(status)); });
}

void StepExchange::Fail(const compress::Partition& partition,
                        absl::Status status, bool ends_call) {
  MutexLock lock(&mu_);
  if (error_.ok()) {
    error_ = absl::Status(
        status.code(),
        absl::StrCat("partition ", partition.id, " of step ", step_, " on ",
                     client_->transport_->address(partition.shard), ": ",
                     status.message()));
  }
  if (ends_call) --in_flight_;
}

void StepExchange::OnDone(PushCall* raw, const absl::Status& status) {
  std::unique_ptr<PushCall> done =
      recovery_.OnAnswer(std::unique_ptr<PushCall>(raw), status);
  if (done == nullptr) return;  // retried, or replaying: recovery's
  if (pool_ != nullptr) {
    // Decoding and applying the reply is the worker's work of the step:
    // on the compute pool, off gRPC's thread.
    pool_->Schedule([this, done = std::move(done), status]() mutable {
      Deliver(std::move(done), status);
    });
    return;
  }
  Deliver(std::move(done), status);
}

void StepExchange::Deliver(std::unique_ptr<PushCall> done,
                           const absl::Status& status) {
  absl::Status result = status;
  const absl::Time start = absl::Now();
  if (done->issued_us >= 0 && !done->replay) {
    // From the push leaving to its reply being here: the wire both ways
    // and the shard's wait for every worker.
    trace::Complete("round trip", done->issued_us, step_, done->partition->id);
  }
  if (result.ok()) {
    ReplyExtras extras;
    if (done->reply.has_grad_sum_of_squares())
      extras.sum_of_squares = done->reply.grad_sum_of_squares();
    if (done->reply.has_grad_sum_abs() && done->reply.has_grad_max_abs()) {
      extras.other = compress::OtherNorms{done->reply.grad_sum_abs(),
                                          done->reply.grad_max_abs()};
    }
    extras.piece_stats.assign(done->reply.piece_stats().begin(),
                              done->reply.piece_stats().end());
    result = apply_(*done->partition, done->reply.payload(), std::move(extras));
  }
  const double apply_seconds = Since(start);
  const compress::Partition* partition = done->partition;
  const size_t bytes_down = done->reply.payload().size();
  std::string buffers = partition->id == 0
                            ? std::move(*done->reply.mutable_buffers())
                            : std::string();
  std::vector<uint32_t> absent(done->reply.absent().begin(),
                               done->reply.absent().end());
  if (result.ok()) {
    recovery_.Applied(*partition, std::move(done->request),
                      done->reply.payload(), absent);
  }
  done.reset();
  MutexLock lock(&mu_);
  if (!result.ok() && error_.ok()) {
    error_ = absl::Status(
        result.code(),
        absl::StrCat("partition ", partition->id, " of step ", step_, " on ",
                     client_->transport_->address(partition->shard), ": ",
                     result.message()));
  }
  traffic_.payload_down += bytes_down;
  if (result.ok() && partition->id == 0) received_buffers_ = std::move(buffers);
  if (result.ok() && !absent.empty())
    absent_[partition->id] = std::move(absent);
  traffic_.apply_seconds += apply_seconds;
  --in_flight_;
}

absl::Status StepExchange::Send(const compress::Partition& partition,
                                const Encode& encode) {
  auto call = std::make_unique<PushCall>();
  call->partition = &partition;
  call->request.set_step(step_);
  call->request.set_rank(client_->rank_);
  call->request.set_partition(partition.id);
  call->request.set_layout_fingerprint(client_->layout_.fingerprint());
  call->request.set_codec(static_cast<v1::Codec>(wire_codec_));
  if (const compress::StepHyper* hyper = HyperOf(extras_.hyper, partition);
      hyper != nullptr) {
    call->request.set_lr(hyper->lr);
    call->request.set_weight_decay(hyper->weight_decay);
    if (hyper->moments.has_value()) {
      call->request.set_beta1(hyper->moments->beta1);
      call->request.set_beta2(hyper->moments->beta2);
      call->request.set_eps(hyper->moments->eps);
    }
    if (hyper->first_step != 0) call->request.set_first_step(hyper->first_step);
  }
  if (partition.id == 0 && !extras_.buffers.empty()) {
    call->request.set_buffers(std::move(extras_.buffers));
  }
  for (double value : extras_.previous_commit)
    call->request.add_previous_commit(value);
  if (extras_.previous_clip_max_norm.has_value()) {
    call->request.set_previous_clip_max_norm(*extras_.previous_clip_max_norm);
  }
  for (const compress::ClipPiece& piece : extras_.previous_clip_pieces) {
    call->request.add_previous_clip_piece_ends(piece.end);
    call->request.add_previous_clip_piece_scales(piece.scale);
  }
  if (extras_.previous_amended != nullptr) {
    call->request.set_previous_amended(
        reinterpret_cast<const char*>(extras_.previous_amended->data() +
                                      partition.range.begin),
        4 * partition.range.size());
  }
  call->request.set_workers_clip(extras_.workers_clip);
  if (!extras_.x.empty()) {
    call->request.set_x_hash(compress::XHash(
        extras_.x.subspan(partition.range.begin, partition.range.size())));
  }
  if (extras_.previous_grad_sum_of_squares.has_value()) {
    call->request.set_previous_grad_sum_of_squares(
        *extras_.previous_grad_sum_of_squares);
  }
  if (pool_ != nullptr && parallel_encode_) {
    // The caller goes on (computing the next partitions' gradient) while
    // the sender waits for a slot and a pool thread encodes and pushes this
    // one; an error shows in Finish.
    MutexLock lock(&mu_);
    if (!error_.ok()) return error_;
    queue_.push_back({std::move(call), encode});
    if (!sender_.joinable()) sender_ = std::thread([this] { SendQueued(); });
    return absl::OkStatus();
  }
  {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StepExchange::CanSend));
    if (!error_.ok()) return error_;
    ++in_flight_;
    recovery_.Sending(partition.id);
  }
  return EncodeAndIssue(std::move(call), encode, /*inline_call=*/true);
}

absl::Status StepExchange::EncodeAndIssue(std::unique_ptr<PushCall> call,
                                          const Encode& encode,
                                          bool inline_call) {
  const absl::Time start = absl::Now();
  absl::Status encoded =
      encode(*call->partition, call->request.mutable_payload());
  {
    MutexLock lock(&mu_);
    const double seconds = Since(start);
    traffic_.encode_seconds += seconds;
    if (inline_call) traffic_.encode_inline_seconds += seconds;
    traffic_.payload_up += call->request.payload().size();
    if (!encoded.ok()) {
      if (error_.ok()) error_ = encoded;
      --in_flight_;
      return encoded;
    }
  }
  Issue(std::move(call));
  return absl::OkStatus();
}

absl::Status StepExchange::Finish(StepTraffic* traffic) {
  {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StepExchange::Idle));
  }
  // Its own pushes have ended; recovery's re-sends of completed partitions
  // may still be on their way (none starts after this).
  recovery_.Wait();
  MutexLock lock(&mu_);
  traffic_.retries = recovery_.retries();
  if (traffic != nullptr) *traffic = traffic_;
  return error_;
}

}  // namespace morse::worker
