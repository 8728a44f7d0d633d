// HttpEndpoint: the daemons' plain-HTTP side door (Boost.Beast on Asio):
//   GET /metrics  the registry in the Prometheus text format
//   GET /healthz  200 while the process runs
//   GET /readyz   200 when ready() says so (server: shard configured and
//                 accepting; worker: joined every shard), 503 otherwise
// One thread serves one request per connection. Stops when destroyed.
#ifndef MORSE_PROTO_HTTP_ENDPOINT_H_
#define MORSE_PROTO_HTTP_ENDPOINT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace morse::proto {

class HttpEndpoint {
 public:
  // `address` is host:port; port 0 picks a free one (see port()).
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(
      const std::string& address,
      std::shared_ptr<prometheus::Registry> registry,
      std::function<bool()> ready);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }

 private:
  struct Impl;
  explicit HttpEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace morse::proto

#endif  // MORSE_PROTO_HTTP_ENDPOINT_H_
