#include "tests/inproc/faults.h"

#include "absl/strings/str_format.h"

namespace morse::inproc {

std::string FaultPlan::ToString() const {
  return absl::StrFormat(
      "refuse %.2f, lose reply %.2f, duplicate %.2f, drop %.2f, delay up to "
      "%s, every %d-th shard info lost, seed %d",
      refuse, lose_reply, duplicate, drop, absl::FormatDuration(max_delay),
      lose_shard_info_every, seed);
}

void FaultyTransport::GetShardInfo(uint32_t shard,
                                   const v1::ShardInfoRequest& request,
                                   v1::ShardInfo* reply,
                                   const worker::CallOptions& options,
                                   Done done) {
  const int every = plan_.lose_shard_info_every;
  if (every <= 0 || ++shard_info_calls_ % every != 0)
    return inner_->GetShardInfo(shard, request, reply, options,
                                std::move(done));
  ++injected_;
  inner_->GetShardInfo(
      shard, request, reply, options,
      [done = std::move(done)](absl::Status) mutable {
        done(absl::UnavailableError(
            "injected: the connection was lost under the call"));
      });
}

FaultyTransport::FaultyTransport(std::unique_ptr<worker::Transport> inner,
                                 FaultPlan plan)
    : inner_(std::move(inner)), plan_(plan), random_(plan.seed) {}

FaultyTransport::~FaultyTransport() {
  // A duplicate's reply goes nowhere, but its call must end before the
  // transport under it does.
  while (duplicates_.load() > 0) absl::SleepFor(absl::Milliseconds(1));
}

FaultyTransport::Fault FaultyTransport::Draw(absl::Duration* delay) {
  MutexLock lock(&mu_);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  *delay = plan_.max_delay * uniform(random_);
  double u = uniform(random_);
  for (auto [rate, fault] : {std::pair{plan_.refuse, Fault::kRefuse},
                             {plan_.lose_reply, Fault::kLoseReply},
                             {plan_.duplicate, Fault::kDuplicate},
                             {plan_.drop, Fault::kDrop}}) {
    if (u < rate) return fault;
    u -= rate;
  }
  return Fault::kNone;
}

template <typename Request, typename Reply>
void FaultyTransport::Inject(Call<Request, Reply> call, uint32_t shard,
                             const Request& request, Reply* reply,
                             const worker::CallOptions& options, Done done) {
  absl::Duration delay;
  const Fault fault = Draw(&delay);
  if (fault != Fault::kNone) ++injected_;
  if (delay <= absl::ZeroDuration())
    return Send(call, shard, request, reply, options, std::move(done), fault);
  timer_.After(delay, [this, call, shard, &request, reply, options,
                       done = std::move(done), fault]() mutable {
    Send(call, shard, request, reply, options, std::move(done), fault);
  });
}

template <typename Request, typename Reply>
void FaultyTransport::Send(Call<Request, Reply> call, uint32_t shard,
                           const Request& request, Reply* reply,
                           const worker::CallOptions& options, Done done,
                           Fault fault) {
  worker::Transport& inner = *inner_;
  switch (fault) {
    case Fault::kNone:
      return (inner.*call)(shard, request, reply, options, std::move(done));
    case Fault::kRefuse:
      return done(absl::UnavailableError("injected: connection refused"));
    case Fault::kDrop:
      timer_.After(absl::Seconds(options.timeout_seconds),
                   [done = std::move(done)]() mutable {
                     done(absl::DeadlineExceededError("injected: dropped"));
                   });
      return;
    case Fault::kLoseReply: {
      auto lost = std::make_shared<Reply>();
      return (inner.*call)(
          shard, request, lost.get(), options,
          [lost, done = std::move(done)](absl::Status) mutable {
            done(absl::UnavailableError("injected: the reply was lost"));
          });
    }
    case Fault::kDuplicate: {
      auto copy = std::make_shared<Request>(request);
      auto twin = std::make_shared<Reply>();
      ++duplicates_;
      (inner.*call)(shard, *copy, twin.get(), options,
                    [this, copy, twin](absl::Status) { --duplicates_; });
      return (inner.*call)(shard, request, reply, options, std::move(done));
    }
  }
}

}  // namespace morse::inproc
