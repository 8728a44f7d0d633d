#include "worker/stage_link.h"

#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "compress/sync.h"
#include "grpcpp/grpcpp.h"
#include "proto/address.h"
#include "proto/morse.grpc.pb.h"
#include "proto/wire.h"

namespace morse::worker {
namespace {

v1::BoundaryFrame ToProto(const StageFrame& frame) {
  v1::BoundaryFrame f;
  f.set_kind(frame.kind);
  f.set_meta(frame.meta);
  f.set_payload(frame.payload);
  f.set_extra(frame.extra);
  f.set_error(frame.error);
  return f;
}

StageFrame FromProto(v1::BoundaryFrame* f) {
  StageFrame frame;
  frame.kind = f->kind();
  frame.meta = std::move(*f->mutable_meta());
  frame.payload = std::move(*f->mutable_payload());
  frame.extra = std::move(*f->mutable_extra());
  frame.error = std::move(*f->mutable_error());
  return frame;
}

// Keepalive on both ends, so a peer that vanishes without closing its
// connection (a dead host, a cut link) is noticed within ~20 s.
void AddKeepalive(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args->SetMaxReceiveMessageSize(INT_MAX);
  args->SetMaxSendMessageSize(INT_MAX);
}

}  // namespace

class StageLink::Endpoint {
 public:
  virtual ~Endpoint() = default;
  virtual bool Write(const v1::BoundaryFrame& frame) = 0;
};

namespace {

class ServerEndpoint : public StageLink::Endpoint {
 public:
  explicit ServerEndpoint(
      grpc::ServerReaderWriter<v1::BoundaryFrame, v1::BoundaryFrame>* stream)
      : stream_(stream) {}
  bool Write(const v1::BoundaryFrame& frame) override {
    return stream_->Write(frame);
  }

 private:
  grpc::ServerReaderWriter<v1::BoundaryFrame, v1::BoundaryFrame>* stream_;
};

}  // namespace

class ClientEndpoint : public StageLink::Endpoint {
 public:
  bool Write(const v1::BoundaryFrame& frame) override {
    return stream->Write(frame);
  }

  grpc::ClientContext context;
  std::unique_ptr<v1::Stage::Stub> stub;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::BoundaryFrame, v1::BoundaryFrame>>
      stream;
  std::thread reader;
  Notification reader_done;
};

class StageService final : public v1::Stage::Service {
 public:
  StageService(StageLink* link, std::unique_ptr<proto::TokenFile> tokens)
      : link_(link), tokens_(std::move(tokens)) {}

  grpc::Status Boundary(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::BoundaryFrame, v1::BoundaryFrame>* stream)
      override {
    if (grpc::Status s = proto::CheckBearerToken(*context, tokens_.get());
        !s.ok())
      return s;
    ServerEndpoint endpoint(stream);
    {
      MutexLock lock(&link_->mu_);
      if (link_->endpoint_ != nullptr || !link_->gone_.empty() ||
          link_->closing_) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            "this stage already has its previous stage "
                            "connected (or had, and lost it); "
                            "a pipeline restarts as a whole");
      }
      link_->endpoint_ = &endpoint;
    }
    v1::BoundaryFrame frame;
    while (stream->Read(&frame)) {
      const size_t bytes = frame.ByteSizeLong();
      link_->Deliver(FromProto(&frame), bytes);
    }
    link_->PeerGone(
        context->IsCancelled()
            ? "its connection was lost (the process died or the network failed)"
            : "it closed the stream");
    // The stage may still be sending through `endpoint`: stay until it closes.
    MutexLock lock(&link_->mu_);
    link_->mu_.Await(absl::Condition(&link_->closing_));
    link_->endpoint_ = nullptr;
    return grpc::Status::OK;
  }

 private:
  StageLink* const link_;
  const std::unique_ptr<proto::TokenFile> tokens_;
};

absl::StatusOr<std::unique_ptr<StageLink>> StageLink::Listen(
    const std::string& address, const proto::SecurityOptions& security) {
  if (auto split = proto::SplitHostPort(address, "the stage's address");
      !split.ok())
    return split.status();
  if (absl::Status s = proto::ValidateServerSecurity(security); !s.ok())
    return s;
  auto tokens = proto::TokenFile::FromOptions(security);
  if (!tokens.ok()) return tokens.status();
  std::unique_ptr<StageLink> link(new StageLink(address, /*listening=*/true));
  link->service_ =
      std::make_unique<StageService>(link.get(), *std::move(tokens));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, proto::MakeServerCredentials(security),
                           &port);
  builder.RegisterService(link->service_.get());
  // A taken port fails below (gRPC's default SO_REUSEPORT would share it).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  link->server_ = builder.BuildAndStart();
  if (link->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address,
        " for the previous stage (in use, or not this host's address)"));
  }
  const size_t colon = address.rfind(':');
  const_cast<std::string&>(link->address_) =
      absl::StrCat(address.substr(0, colon), ":", port);
  return link;
}

absl::StatusOr<std::unique_ptr<StageLink>> StageLink::Connect(
    const std::string& address, const proto::SecurityOptions& security,
    absl::Duration timeout) {
  if (absl::Status s = proto::ValidateClientSecurity(security); !s.ok())
    return s;
  auto tokens = proto::TokenFile::FromOptions(security);
  if (!tokens.ok()) return tokens.status();
  grpc::ChannelArguments args;
  AddKeepalive(&args);
  proto::AddChannelSecurityArgs(security, &args);
  auto channel = grpc::CreateCustomChannel(
      address, proto::MakeChannelCredentials(security), args);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "the next stage at ", address, " did not accept a connection within ",
        absl::FormatDuration(timeout),
        " (is it running and listening there?)"));
  }
  std::unique_ptr<StageLink> link(new StageLink(address, /*listening=*/false));
  auto endpoint = std::make_unique<ClientEndpoint>();
  if (*tokens != nullptr) {
    endpoint->context.AddMetadata(
        proto::kAuthorizationKey,
        absl::StrCat(proto::kBearerPrefix, (*tokens)->Current()));
  }
  endpoint->stub = v1::Stage::NewStub(channel);
  endpoint->stream = endpoint->stub->Boundary(&endpoint->context);
  ClientEndpoint* raw = endpoint.get();
  StageLink* owner = link.get();
  endpoint->reader = std::thread([raw, owner] {
    v1::BoundaryFrame frame;
    while (raw->stream->Read(&frame)) {
      const size_t bytes = frame.ByteSizeLong();
      owner->Deliver(FromProto(&frame), bytes);
    }
    const grpc::Status status = raw->stream->Finish();
    owner->PeerGone(status.ok()
                        ? "it closed the stream"
                        : absl::StrCat(proto::FromGrpc(status).ToString()));
    raw->reader_done.Notify();
  });
  link->Attach(raw);
  link->client_ = std::move(endpoint);
  return link;
}

StageLink::StageLink(std::string address, bool listening)
    : address_(std::move(address)), listening_(listening) {}

StageLink::~StageLink() { Close(); }

void StageLink::Attach(Endpoint* endpoint) {
  MutexLock lock(&mu_);
  endpoint_ = endpoint;
}

void StageLink::Deliver(StageFrame frame, size_t bytes) {
  MutexLock lock(&mu_);
  bytes_received_ += bytes;
  queue_.push_back(std::move(frame));
}

void StageLink::PeerGone(const std::string& why) {
  MutexLock lock(&mu_);
  if (gone_.empty()) gone_ = why;
}

absl::Status StageLink::Accept(absl::Duration timeout) {
  MutexLock lock(&mu_);
  auto attached = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return endpoint_ != nullptr || !gone_.empty();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&attached), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no previous stage connected to ", address_, " within ",
                     absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::Status StageLink::Send(const StageFrame& frame) {
  const v1::BoundaryFrame f = ToProto(frame);
  Endpoint* endpoint = nullptr;
  {
    MutexLock lock(&mu_);
    if (closing_) return absl::FailedPreconditionError("the link is closed");
    if (endpoint_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no previous stage has connected to ", address_, " yet"));
    }
    endpoint = endpoint_;
  }
  // Not under mu_: a write may wait for the peer to read, and the peer may be
  // waiting for this end's reader to take its frames.
  if (!endpoint->Write(f)) {
    MutexLock lock(&mu_);
    return absl::UnavailableError(absl::StrCat(
        listening_ ? "the previous stage" : "the next stage", " (", address_,
        ") is gone: ", gone_.empty() ? "the stream broke" : gone_));
  }
  MutexLock lock(&mu_);
  bytes_sent_ += f.ByteSizeLong();
  return absl::OkStatus();
}

absl::StatusOr<StageFrame> StageLink::Receive(absl::Duration timeout) {
  MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || !gone_.empty();
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (!queue_.empty()) {
    StageFrame frame = std::move(queue_.front());
    queue_.pop_front();
    return frame;
  }
  const char* peer = listening_ ? "the previous stage" : "the next stage";
  if (!gone_.empty()) {
    return absl::UnavailableError(
        absl::StrCat(peer, " (", address_, ") is gone: ", gone_));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(peer, " (", address_, ") sent nothing for ",
                   absl::FormatDuration(timeout)));
}

void StageLink::Close() {
  {
    MutexLock lock(&mu_);
    if (closing_) return;
    closing_ = true;
  }
  if (client_ != nullptr) {
    client_->stream->WritesDone();
    // The next stage ends its side when it closes; do not wait for it long.
    if (!client_->reader_done.WaitForNotificationWithTimeout(absl::Seconds(2)))
      client_->context.TryCancel();
    client_->reader.join();
  }
  if (server_ != nullptr)
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
}

uint64_t StageLink::bytes_sent() const {
  MutexLock lock(&mu_);
  return bytes_sent_;
}

uint64_t StageLink::bytes_received() const {
  MutexLock lock(&mu_);
  return bytes_received_;
}

}  // namespace morse::worker
