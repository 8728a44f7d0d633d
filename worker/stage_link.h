// StageLink: one boundary between two pipeline stages (docs/design.md 2.9),
// one long-lived bidirectional gRPC stream (morse.v1.Stage/Boundary). The
// later stage listens; the earlier one connects. Either end sends and
// receives frames; what they mean is morse.torch.pipeline's business.
//
// A peer that goes away (its process dies, its host drops off the network,
// it closes the stream) makes Receive return UNAVAILABLE naming the peer
// and gRPC's reason, at once for a closed connection and within the
// keepalive (20 s) for a silent one; a peer that is alive but sends nothing
// makes Receive return DEADLINE_EXCEEDED after its timeout. Neither hangs.
//
// Thread-compatible: one thread sends and receives (the stage's loop); the
// link's own threads read the stream into a queue.
#ifndef MORSE_WORKER_STAGE_LINK_H_
#define MORSE_WORKER_STAGE_LINK_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compress/sync.h"
#include "proto/security.h"

namespace morse::worker {

class ClientEndpoint;
class StageService;

struct StageFrame {
  enum Kind : uint32_t {
    kHello = 0,
    kForward = 1,
    kBackward = 2,
    kError = 3,
    kEnd = 4
  };
  uint32_t kind = kHello;
  std::string meta;
  std::string payload;
  std::string extra;
  std::string error;
};

class StageLink {
 public:
  // The later stage's end: listens on `address` ("host:port"; port 0 picks
  // one, see address()) for the earlier stage's stream. `security` as for
  // a server (proto/security.h): TLS, client CAs, token file, or insecure.
  static absl::StatusOr<std::unique_ptr<StageLink>> Listen(
      const std::string& address, const proto::SecurityOptions& security);
  // The earlier stage's end: opens the stream to `address`, retrying until
  // the listener is up or `timeout` passes (UNAVAILABLE naming the address).
  static absl::StatusOr<std::unique_ptr<StageLink>> Connect(
      const std::string& address, const proto::SecurityOptions& security,
      absl::Duration timeout);

  ~StageLink();
  StageLink(const StageLink&) = delete;
  StageLink& operator=(const StageLink&) = delete;

  // Listening end: waits until the earlier stage has opened its stream
  // (DEADLINE_EXCEEDED after `timeout`). Connect's links are attached.
  absl::Status Accept(absl::Duration timeout);
  absl::Status Send(const StageFrame& frame);
  absl::StatusOr<StageFrame> Receive(absl::Duration timeout);
  // Ends the stream (the peer's Receive then reports the stream closed) and
  // stops listening. Idempotent; the destructor calls it.
  void Close();

  // The listening address with its real port, or the address connected to.
  const std::string& address() const { return address_; }
  uint64_t bytes_sent() const;
  uint64_t bytes_received() const;

  class Endpoint;  // the stream's transport, client or server side

 private:
  friend class StageService;
  StageLink(std::string address, bool listening);

  // Called from the transport's reading thread.
  void Deliver(StageFrame frame, size_t bytes);
  void PeerGone(const std::string& why);
  void Attach(Endpoint* endpoint);

  const std::string address_;
  const bool listening_;
  mutable Mutex mu_;
  Endpoint* endpoint_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::deque<StageFrame> queue_ ABSL_GUARDED_BY(mu_);
  std::string gone_ ABSL_GUARDED_BY(mu_);  // why the peer is gone, once it is
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<ClientEndpoint> client_;  // Connect's stream
  std::unique_ptr<StageService> service_;   // Listen's server
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_STAGE_LINK_H_
