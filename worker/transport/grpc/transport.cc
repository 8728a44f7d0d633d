#include "worker/transport/grpc/transport.h"

#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "proto/address.h"
#include "proto/wire.h"

namespace morse::worker {

absl::StatusOr<std::unique_ptr<GrpcTransport>> GrpcTransport::Create(
    const proto::JobSpec& job, std::vector<std::string> servers, uint32_t rank,
    const proto::SecurityOptions& security) {
  if (servers.size() != job.shards()) {
    return absl::InvalidArgumentError(absl::StrCat(
        servers.size(), " server addresses for a job of ", job.shards(),
        " shards; pass one host:port per shard, in shard order"));
  }
  if (rank >= job.workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " is outside the job's ", job.workers(), " workers"));
  }
  for (size_t s = 0; s < servers.size(); ++s) {
    const auto split = proto::SplitHostPort(
        servers[s], absl::StrCat("shard ", s, "'s address"));
    if (!split.ok()) return split.status();
  }
  proto::SecurityOptions own = security;
  own.token_file =
      proto::TokenPathForRank(security.token_file, rank);  // token-{rank}
  if (absl::Status s = proto::ValidateClientSecurity(own); !s.ok()) return s;
  auto tokens = proto::TokenFile::FromOptions(own);
  if (!tokens.ok()) return tokens.status();
  return std::unique_ptr<GrpcTransport>(
      new GrpcTransport(job, std::move(servers), security, *std::move(tokens)));
}

GrpcTransport::GrpcTransport(const proto::JobSpec& job,
                             std::vector<std::string> servers,
                             const proto::SecurityOptions& security,
                             std::unique_ptr<proto::TokenFile> tokens)
    : servers_(std::move(servers)),
      tokens_(std::move(tokens)),
      uploads_per_shard_(job.uploads_per_shard) {
  const std::shared_ptr<grpc::ChannelCredentials> credentials =
      proto::MakeChannelCredentials(security);
  for (const std::string& address : servers_) {
    auto& shard_stubs = stubs_.emplace_back();
    for (uint32_t c = 0; c < std::max<uint32_t>(job.channels_per_shard, 1);
         ++c) {
      grpc::ChannelArguments args =
          proto::ChannelArgs(job, static_cast<int>(c));
      proto::AddChannelSecurityArgs(security, &args);
      shard_stubs.push_back(v1::ParameterServer::NewStub(
          grpc::CreateCustomChannel(address, credentials, args)));
    }
    uploads_.push_back(std::make_unique<Uploads>());
  }
}

GrpcTransport::~GrpcTransport() {
  // A push frees its place (Uploaded) before its `done` runs, and only then
  // is it no longer this transport's.
  for (auto& uploads : uploads_) {
    MutexLock lock(&uploads->mu);
    uploads->mu.Await(absl::Condition(
        +[](Uploads* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu) {
          return u->sending == 0 && u->waiting.empty();
        },
        uploads.get()));
  }
}

std::chrono::system_clock::time_point GrpcTransport::Deadline(
    const CallOptions& options) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(
             static_cast<int64_t>(options.timeout_seconds * 1e6));
}

v1::ParameterServer::Stub::async_interface* GrpcTransport::Prepare(
    grpc::ClientContext* context, uint32_t shard,
    std::chrono::system_clock::time_point deadline,
    const CallOptions& options) const {
  context->set_deadline(deadline);
  if (options.wait_for_ready) context->set_wait_for_ready(true);
  if (tokens_ != nullptr) {
    context->AddMetadata(
        proto::kAuthorizationKey,
        absl::StrCat(proto::kBearerPrefix, tokens_->Current()));
  }
  const auto& channels = stubs_[shard];
  return channels[options.lane % channels.size()]->async();
}

template <typename Request, typename Reply, typename Method>
void GrpcTransport::Start(uint32_t shard, Method method, const Request& request,
                          Reply* reply, const CallOptions& options, Done done) {
  auto* context = new grpc::ClientContext;
  v1::ParameterServer::Stub::async_interface* stub =
      Prepare(context, shard, Deadline(options), options);
  (stub->*method)(context, &request, reply,
                  [context, done = std::move(done)](grpc::Status status) {
                    absl::Status outcome = proto::FromGrpc(
                        status, context->GetServerTrailingMetadata());
                    delete context;
                    done(std::move(outcome));
                  });
}

// The async interface's methods are overloaded (callback and reactor
// forms); these name the callback one.
template <typename Request, typename Reply>
using AsyncMethod = void (v1::ParameterServer::Stub::async_interface::*)(
    grpc::ClientContext*, const Request*, Reply*,
    std::function<void(grpc::Status)>);

void GrpcTransport::Join(uint32_t shard, const v1::JoinRequest& request,
                         v1::JoinReply* reply, const CallOptions& options,
                         Done done) {
  Start(shard,
        AsyncMethod<v1::JoinRequest, v1::JoinReply>(
            &v1::ParameterServer::Stub::async_interface::Join),
        request, reply, options, std::move(done));
}

void GrpcTransport::InitPartition(uint32_t shard,
                                  const v1::InitPartitionRequest& request,
                                  v1::InitPartitionReply* reply,
                                  const CallOptions& options, Done done) {
  Start(shard,
        AsyncMethod<v1::InitPartitionRequest, v1::InitPartitionReply>(
            &v1::ParameterServer::Stub::async_interface::InitPartition),
        request, reply, options, std::move(done));
}

// One push: its context lives with it, and it frees its place among the
// shard's uploads once the shard has it.
class GrpcTransport::PushCall final : public grpc::ClientUnaryReactor {
 public:
  PushCall(GrpcTransport* transport, uint32_t shard, Done done)
      : transport_(transport), shard_(shard), done_(std::move(done)) {}

  grpc::ClientContext* context() { return &context_; }

  void OnReadInitialMetadataDone(bool /*ok*/) override { Uploaded(); }
  void OnDone(const grpc::Status& status) override {
    Uploaded();
    absl::Status outcome =
        proto::FromGrpc(status, context_.GetServerTrailingMetadata());
    Done done = std::move(done_);
    delete this;
    done(std::move(outcome));
  }

 private:
  void Uploaded() {
    if (!uploaded_.exchange(true)) transport_->Uploaded(shard_);
  }

  GrpcTransport* const transport_;
  const uint32_t shard_;
  Done done_;
  grpc::ClientContext context_;
  std::atomic<bool> uploaded_{false};
};

void GrpcTransport::Push(uint32_t shard, const v1::PushRequest& request,
                         v1::PushReply* reply, const CallOptions& options,
                         Done done) {
  // The deadline counts from here, waiting for the upload's turn included.
  const auto deadline = Deadline(options);
  Uploads& uploads = *uploads_[shard];
  {
    MutexLock lock(&uploads.mu);
    if (uploads_per_shard_ > 0 && uploads.sending >= uploads_per_shard_) {
      uploads.waiting.push_back([this, shard, &request, reply, options,
                                 deadline, done = std::move(done)]() mutable {
        StartPush(shard, request, reply, options, deadline, std::move(done));
      });
      return;
    }
    ++uploads.sending;
  }
  StartPush(shard, request, reply, options, deadline, std::move(done));
}

void GrpcTransport::StartPush(uint32_t shard, const v1::PushRequest& request,
                              v1::PushReply* reply, const CallOptions& options,
                              std::chrono::system_clock::time_point deadline,
                              Done done) {
  auto* call = new PushCall(this, shard, std::move(done));
  Prepare(call->context(), shard, deadline, options)
      ->Push(call->context(), &request, reply, call);
  call->StartCall();
}

void GrpcTransport::Uploaded(uint32_t shard) {
  Uploads& uploads = *uploads_[shard];
  std::function<void()> next;
  {
    MutexLock lock(&uploads.mu);
    if (uploads.waiting.empty()) {
      --uploads.sending;
      return;
    }
    next = std::move(uploads.waiting.front());
    uploads.waiting.pop_front();
  }
  next();  // takes the place this push frees
}

void GrpcTransport::FetchPartition(uint32_t shard,
                                   const v1::FetchPartitionRequest& request,
                                   v1::PartitionState* reply,
                                   const CallOptions& options, Done done) {
  Start(shard,
        AsyncMethod<v1::FetchPartitionRequest, v1::PartitionState>(
            &v1::ParameterServer::Stub::async_interface::FetchPartition),
        request, reply, options, std::move(done));
}

void GrpcTransport::RestorePartition(uint32_t shard,
                                     const v1::PartitionState& request,
                                     v1::RestorePartitionReply* reply,
                                     const CallOptions& options, Done done) {
  Start(shard,
        AsyncMethod<v1::PartitionState, v1::RestorePartitionReply>(
            &v1::ParameterServer::Stub::async_interface::RestorePartition),
        request, reply, options, std::move(done));
}

void GrpcTransport::Abort(uint32_t shard, const v1::AbortRequest& request,
                          v1::AbortReply* reply, const CallOptions& options,
                          Done done) {
  Start(shard,
        AsyncMethod<v1::AbortRequest, v1::AbortReply>(
            &v1::ParameterServer::Stub::async_interface::Abort),
        request, reply, options, std::move(done));
}

void GrpcTransport::Commit(uint32_t shard, const v1::CommitRequest& request,
                           v1::CommitReply* reply, const CallOptions& options,
                           Done done) {
  Start(shard,
        AsyncMethod<v1::CommitRequest, v1::CommitReply>(
            &v1::ParameterServer::Stub::async_interface::Commit),
        request, reply, options, std::move(done));
}

void GrpcTransport::GetShardInfo(uint32_t shard,
                                 const v1::ShardInfoRequest& request,
                                 v1::ShardInfo* reply,
                                 const CallOptions& options, Done done) {
  Start(shard,
        AsyncMethod<v1::ShardInfoRequest, v1::ShardInfo>(
            &v1::ParameterServer::Stub::async_interface::GetShardInfo),
        request, reply, options, std::move(done));
}

}  // namespace morse::worker
