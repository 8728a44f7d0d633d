#include "proto/http_endpoint.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "prometheus/text_serializer.h"
#include "proto/address.h"

namespace morse::proto {

namespace http = boost::beast::http;
using boost::asio::ip::tcp;

struct HttpEndpoint::Impl {
  boost::asio::io_context io;
  tcp::acceptor acceptor{io};
  std::shared_ptr<prometheus::Registry> registry;
  std::function<bool()> ready;
  std::atomic<bool> stopping{false};

  void Serve(tcp::socket& socket) {
    boost::beast::flat_buffer buffer;
    http::request<http::string_body> request;
    boost::system::error_code error;
    http::read(socket, buffer, request, error);
    if (error) return;
    http::response<http::string_body> response;
    response.version(request.version());
    response.keep_alive(false);
    const std::string target(request.target());
    if (request.method() != http::verb::get) {
      response.result(http::status::method_not_allowed);
      response.body() = "GET only\n";
    } else if (target == "/metrics") {
      response.result(http::status::ok);
      response.set(http::field::content_type, "text/plain; version=0.0.4");
      response.body() =
          prometheus::TextSerializer().Serialize(registry->Collect());
    } else if (target == "/healthz") {
      response.result(http::status::ok);
      response.body() = "ok\n";
    } else if (target == "/readyz") {
      const bool is_ready = ready == nullptr || ready();
      response.result(is_ready ? http::status::ok
                               : http::status::service_unavailable);
      response.body() = is_ready ? "ready\n" : "not ready\n";
    } else {
      response.result(http::status::not_found);
      response.body() = "try /metrics, /healthz or /readyz\n";
    }
    response.prepare_payload();
    http::write(socket, response, error);
    socket.shutdown(tcp::socket::shutdown_send, error);
  }
};

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::function<bool()> ready) {
  auto impl = std::make_unique<Impl>();
  impl->registry = std::move(registry);
  impl->ready = std::move(ready);
  const absl::StatusOr<HostPort> split = SplitHostPort(address, "HTTP address");
  if (!split.ok()) return split.status();
  boost::system::error_code error;
  const auto host = boost::asio::ip::make_address(split->host, error);
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HTTP address '", address, "': the host is not an IP address"));
  }
  const tcp::endpoint endpoint(host, split->port);
  impl->acceptor.open(endpoint.protocol(), error);
  if (!error)
    impl->acceptor.set_option(tcp::acceptor::reuse_address(true), error);
  if (!error) impl->acceptor.bind(endpoint, error);
  if (!error) impl->acceptor.listen(16, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", address, ": ", error.message()));
  }
  std::unique_ptr<HttpEndpoint> endpoint_owner(
      new HttpEndpoint(std::move(impl)));
  return endpoint_owner;
}

HttpEndpoint::HttpEndpoint(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {
  port_ = impl_->acceptor.local_endpoint().port();
  thread_ = std::thread([impl = impl_.get()] {
    while (!impl->stopping.load()) {
      tcp::socket socket(impl->io);
      boost::system::error_code error;
      impl->acceptor.accept(socket, error);
      if (impl->stopping.load()) break;  // the destructor's wake-up call
      if (error) continue;
      impl->Serve(socket);
    }
  });
}

HttpEndpoint::~HttpEndpoint() {
  impl_->stopping = true;
  // Wake the blocking accept with a connection of our own.
  boost::system::error_code error;
  tcp::socket poke(impl_->io);
  poke.connect(
      tcp::endpoint(impl_->acceptor.local_endpoint().address().is_unspecified()
                        ? boost::asio::ip::make_address("127.0.0.1")
                        : impl_->acceptor.local_endpoint().address(),
                    port_),
      error);
  if (error) impl_->acceptor.close(error);
  poke.close(error);
  thread_.join();
}

}  // namespace morse::proto
