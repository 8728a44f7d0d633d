#include "tests/inproc/cluster.h"

#include <stdlib.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace morse::inproc {

std::string MakeTempDir(const std::string& prefix) {
  std::string path = ::testing::TempDir() + prefix + "-XXXXXX";
  return mkdtemp(path.data()) != nullptr ? path : "";
}

// A push the shard has not answered yet: finished once, by the reply, its
// deadline or the shard's death, whichever comes first.
struct PendingPush {
  Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;
  v1::PushReply* reply = nullptr;
  worker::Transport::Done done;

  // Whether this caller is the one that finishes it.
  bool Claim() {
    MutexLock lock(&mu);
    if (finished) return false;
    finished = true;
    return true;
  }
};

struct InProcessCluster::Shard {
  // Declared so that the handler goes first and the runtime (the core's
  // step observer) last.
  std::unique_ptr<server::ShardRuntime> runtime;
  std::unique_ptr<server::ShardHost> host;
  std::unique_ptr<server::ShardHandler> handler;
  Mutex mu;
  std::vector<std::weak_ptr<PendingPush>> pending ABSL_GUARDED_BY(mu);
};

class InProcessCluster::ClusterTransport final : public worker::Transport {
 public:
  explicit ClusterTransport(InProcessCluster* cluster) : cluster_(cluster) {
    for (uint32_t s = 0; s < cluster->job_.shards(); ++s)
      addresses_.push_back(absl::StrCat("inproc:", s));
  }

  uint32_t shards() const override {
    return static_cast<uint32_t>(addresses_.size());
  }
  const std::string& address(uint32_t shard) const override {
    return addresses_[shard];
  }

  void Join(uint32_t shard, const v1::JoinRequest& request,
            v1::JoinReply* reply, const worker::CallOptions& options,
            Done done) override {
    Sync(shard, options, std::move(done),
         [&request, reply](server::ShardHandler& h) {
           return h.Join(request, reply);
         });
  }
  void InitPartition(uint32_t shard, const v1::InitPartitionRequest& request,
                     v1::InitPartitionReply* reply,
                     const worker::CallOptions& options, Done done) override {
    Sync(shard, options, std::move(done),
         [&request, reply](server::ShardHandler& h) {
           return h.InitPartition(request, reply);
         });
  }
  void FetchPartition(uint32_t shard, const v1::FetchPartitionRequest& request,
                      v1::PartitionState* reply,
                      const worker::CallOptions& options, Done done) override {
    Sync(shard, options, std::move(done),
         [&request, reply](server::ShardHandler& h) {
           return h.FetchPartition(request, reply);
         });
  }
  void RestorePartition(uint32_t shard, const v1::PartitionState& request,
                        v1::RestorePartitionReply*,
                        const worker::CallOptions& options,
                        Done done) override {
    Sync(shard, options, std::move(done), [&request](server::ShardHandler& h) {
      return h.RestorePartition(request);
    });
  }
  void Abort(uint32_t shard, const v1::AbortRequest& request, v1::AbortReply*,
             const worker::CallOptions& options, Done done) override {
    Sync(shard, options, std::move(done),
         [&request](server::ShardHandler& h) { return h.Abort(request); });
  }
  void Commit(uint32_t shard, const v1::CommitRequest& request,
              v1::CommitReply*, const worker::CallOptions& options,
              Done done) override {
    Sync(shard, options, std::move(done),
         [&request](server::ShardHandler& h) { return h.Commit(request); });
  }
  void GetShardInfo(uint32_t shard, const v1::ShardInfoRequest& request,
                    v1::ShardInfo* reply, const worker::CallOptions& options,
                    Done done) override {
    Sync(shard, options, std::move(done),
         [&request, reply](server::ShardHandler& h) {
           return h.GetShardInfo(request, reply);
         });
  }

  void Push(uint32_t shard, const v1::PushRequest& request,
            v1::PushReply* reply, const worker::CallOptions& options,
            Done done) override {
    std::shared_ptr<Shard> target = cluster_->Get(shard);
    if (target == nullptr) return Deliver(std::move(done), Refused(shard));
    auto pending = std::make_shared<PendingPush>();
    pending->reply = reply;
    pending->done = std::move(done);
    {
      MutexLock lock(&target->mu);
      if (target->pending.size() >= 64) {
        std::erase_if(target->pending,
                      [](const auto& weak) { return weak.expired(); });
      }
      target->pending.push_back(pending);
    }
    InProcessCluster* cluster = cluster_;
    cluster->timer_.After(
        absl::Seconds(options.timeout_seconds), [cluster, pending] {
          cluster->Finish(pending,
                          absl::DeadlineExceededError("Deadline Exceeded"));
        });
    v1::PushRequest copy = request;  // the shard's own, as off a socket
    target->handler->Push(
        copy, [cluster, pending](
                  absl::StatusOr<std::shared_ptr<const server::Reply>> result) {
          cluster->Finish(pending, std::move(result));
        });
  }

 private:
  // Runs `call` against the live shard now and delivers its status; a
  // killed shard refuses, or with wait_for_ready is tried again until the
  // deadline.
  template <typename Call>
  void Sync(uint32_t shard, const worker::CallOptions& options, Done done,
            Call call, absl::Time deadline = absl::InfiniteFuture()) {
    if (deadline == absl::InfiniteFuture())
      deadline = absl::Now() + absl::Seconds(options.timeout_seconds);
    std::shared_ptr<Shard> target = cluster_->Get(shard);
    if (target == nullptr) {
      const absl::Duration poll = absl::Milliseconds(20);
      if (options.wait_for_ready && absl::Now() + poll < deadline) {
        cluster_->timer_.After(
            poll, [this, shard, options, done = std::move(done), call,
                   deadline]() mutable {
              Sync(shard, options, std::move(done), call, deadline);
            });
        return;
      }
      return Deliver(std::move(done),
                     options.wait_for_ready
                         ? absl::DeadlineExceededError("Deadline Exceeded")
                         : Refused(shard));
    }
    absl::Status status = call(*target->handler);
    target.reset();
    Deliver(std::move(done), std::move(status));
  }

  absl::Status Refused(uint32_t shard) const {
    return absl::UnavailableError(absl::StrCat(
        addresses_[shard], ": connection refused (the shard is down)"));
  }

  void Deliver(Done done, absl::Status status) {
    cluster_->delivery_.Schedule(
        [done = std::move(done), status = std::move(status)]() mutable {
          done(std::move(status));
        });
  }

  InProcessCluster* cluster_;
  std::vector<std::string> addresses_;
};

void InProcessCluster::Finish(
    const std::shared_ptr<PendingPush>& pending,
    absl::StatusOr<std::shared_ptr<const server::Reply>> result) {
  delivery_.Schedule([pending, result = std::move(result)]() mutable {
    if (!pending->Claim()) return;
    if (result.ok()) server::ShardHandler::ToMessage(**result, pending->reply);
    worker::Transport::Done done = std::move(pending->done);
    done(result.status());
  });
}

absl::StatusOr<std::unique_ptr<InProcessCluster>> InProcessCluster::Create(
    const proto::JobSpec& job, Options options) {
  if (!job.sized())
    return absl::InvalidArgumentError(
        "the in-process cluster needs a sized job");
  std::unique_ptr<InProcessCluster> cluster(
      new InProcessCluster(job, std::move(options)));
  for (uint32_t s = 0; s < job.shards(); ++s) {
    auto shard = cluster->Start(s);
    if (!shard.ok()) return shard.status();
    MutexLock lock(&cluster->mu_);
    cluster->shards_[s] = *std::move(shard);
  }
  cluster->ticker_ = std::thread([c = cluster.get()] { c->Tick(); });
  return cluster;
}

InProcessCluster::InProcessCluster(const proto::JobSpec& job, Options options)
    : job_(job),
      options_(std::move(options)),
      shards_(job.shards()),
      delivery_(std::max(1, options_.delivery_threads)) {}

InProcessCluster::~InProcessCluster() {
  stopping_ = true;
  if (ticker_.joinable()) ticker_.join();
  for (uint32_t s = 0; s < job_.shards(); ++s) Kill(s);
}

absl::StatusOr<std::shared_ptr<InProcessCluster::Shard>>
InProcessCluster::Start(uint32_t s) {
  auto shard = std::make_shared<Shard>();
  server::ShardRuntime::Options runtime;
  runtime.shard = s;
  if (!options_.checkpoint_dir.empty()) {
    runtime.checkpoint_path =
        absl::StrCat(options_.checkpoint_dir, "/shard-", s, ".ckpt");
  }
  runtime.log = [this](const std::string& line) {
    MutexLock lock(&mu_);
    log_.push_back(line);
  };
  shard->runtime = std::make_unique<server::ShardRuntime>(std::move(runtime));
  server::ShardRuntime* r = shard->runtime.get();
  auto host = server::ShardHost::Create(
      job_, s,
      [r](const proto::JobSpec& job, server::ShardCore& core, bool relaid) {
        return r->OnConfigured(job, core, relaid);
      },
      0, options_.compute_threads);
  if (!host.ok()) return host.status();
  shard->host = *std::move(host);
  shard->handler = std::make_unique<server::ShardHandler>(shard->host.get());
  return shard;
}

std::unique_ptr<worker::Transport> InProcessCluster::Connect() {
  return std::make_unique<ClusterTransport>(this);
}

std::shared_ptr<InProcessCluster::Shard> InProcessCluster::Get(
    uint32_t shard) const {
  MutexLock lock(&mu_);
  return shards_[shard];
}

void InProcessCluster::Kill(uint32_t shard) {
  std::shared_ptr<Shard> dead;
  {
    MutexLock lock(&mu_);
    dead = std::move(shards_[shard]);
  }
  if (dead == nullptr) return;
  // Its connections break: what waits in it fails now, as over TCP.
  std::vector<std::weak_ptr<PendingPush>> pending;
  {
    MutexLock lock(&dead->mu);
    pending.swap(dead->pending);
  }
  for (const auto& weak : pending) {
    if (auto p = weak.lock()) {
      Finish(p, absl::UnavailableError(absl::StrCat(
                    "inproc:", shard, ": connection reset (the shard died)")));
    }
  }
  // Calls inside it (on other threads) return soon; the last reference
  // must go here, not on a thread the core's own pool would have to join.
  while (dead.use_count() > 1) absl::SleepFor(absl::Milliseconds(1));
  dead.reset();
}

absl::Status InProcessCluster::Restart(uint32_t shard) {
  if (Get(shard) != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard, " is running"));
  }
  auto started = Start(shard);
  if (!started.ok()) return started.status();
  MutexLock lock(&mu_);
  shards_[shard] = *std::move(started);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> InProcessCluster::MirrorChecksum(uint32_t shard) {
  std::shared_ptr<Shard> s = Get(shard);
  if (s == nullptr || s->host->core() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard, " is down"));
  }
  return s->host->core()->MirrorChecksum();
}

absl::StatusOr<int64_t> InProcessCluster::CompletedSteps(uint32_t shard) {
  std::shared_ptr<Shard> s = Get(shard);
  if (s == nullptr || s->host->core() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard, " is down"));
  }
  return s->host->core()->Status().completed_steps;
}

std::vector<std::string> InProcessCluster::log() const {
  MutexLock lock(&mu_);
  return log_;
}

void InProcessCluster::Tick() {
  while (!stopping_.load()) {
    for (uint32_t s = 0; s < job_.shards(); ++s) {
      std::shared_ptr<Shard> shard = Get(s);
      if (shard == nullptr) continue;
      if (std::shared_ptr<server::ShardCore> core = shard->host->core())
        shard->runtime->Tick(*core, absl::Now());
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace morse::inproc
