// morse-netprobe: raw TCP throughput between two hosts, the ceiling every
// Morse figure in the experiments is divided by.
//
//   morse-netprobe --listen 198.18.0.1:5201                  # on one host
//   morse-netprobe --connect 198.18.0.1:5201 --streams 4 --seconds 5 --both
//
// The client opens --streams connections; each sends as fast as it can
// (upload) and, with --both, the server sends back at the same time
// (download). After --warmup seconds the client counts bytes for --seconds
// and prints one JSON line with Gbit/s each way. A refused connection is
// tried again for --connect_seconds, so a server started a moment before
// need not be listening yet. The server serves clients until killed.
// Boost.Asio, one thread, 1 MiB buffers.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "boost/asio.hpp"
#include "proto/flags.h"

ABSL_FLAG(std::string, listen, "", "Serve on host:port.");
ABSL_FLAG(std::string, connect, "", "Measure against the server at host:port.");
ABSL_FLAG(int, streams, 1, "Parallel TCP connections.");
ABSL_FLAG(double, seconds, 5.0, "Measured duration.");
ABSL_FLAG(double, warmup, 1.0, "Seconds before measuring (TCP slow start).");
ABSL_FLAG(bool, both, false, "Send in both directions at once (full duplex).");
ABSL_FLAG(double, connect_seconds, 10.0,
          "How long the client tries again while the server refuses "
          "(a server just started may not listen yet).");

namespace {

using boost::asio::ip::tcp;
constexpr size_t kBuffer = 1 << 20;

tcp::endpoint Endpoint(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    std::fprintf(stderr, "morse-netprobe: '%s' is not host:port\n",
                 address.c_str());
    std::exit(2);
  }
  return {boost::asio::ip::make_address(address.substr(0, colon)),
          static_cast<unsigned short>(std::atoi(address.c_str() + colon + 1))};
}

// Reads until the peer closes, counting bytes; writes forever if asked.
struct Pipe : std::enable_shared_from_this<Pipe> {
  explicit Pipe(tcp::socket s)
      : socket(std::move(s)), in(kBuffer), out(kBuffer, 'm') {}
  void Read() {
    auto self = shared_from_this();
    socket.async_read_some(boost::asio::buffer(in),
                           [self](auto error, size_t n) {
                             if (error) return;
                             self->received += n;
                             self->Read();
                           });
  }
  void Write() {
    auto self = shared_from_this();
    socket.async_write_some(boost::asio::buffer(out),
                            [self](auto error, size_t n) {
                              if (error) return;
                              self->sent += n;
                              self->Write();
                            });
  }
  tcp::socket socket;
  std::vector<char> in, out;
  std::atomic<uint64_t> received{0}, sent{0};
};

void Accept(tcp::acceptor& acceptor) {
  acceptor.async_accept([&acceptor](auto error, tcp::socket socket) {
    if (!error) {
      socket.set_option(tcp::no_delay(true));
      auto pipe = std::make_shared<Pipe>(std::move(socket));
      // The first byte says whether the client wants data back.
      auto mode = std::make_shared<char>(0);
      boost::asio::async_read(pipe->socket, boost::asio::buffer(mode.get(), 1),
                              [pipe, mode](auto error, size_t) {
                                if (error) return;
                                pipe->Read();
                                if (*mode == 'B') pipe->Write();
                              });
    }
    Accept(acceptor);
  });
}

}  // namespace

int main(int argc, char** argv) {
  morse::proto::ParseFlags(
      argc, argv,
      "raw TCP throughput probe.\n  morse-netprobe --listen HOST:PORT\n"
      "  morse-netprobe --connect HOST:PORT [--streams K] [--seconds T] "
      "[--both]",
      "netprobe.cc");
  boost::asio::io_context io;
  if (!absl::GetFlag(FLAGS_listen).empty()) {
    tcp::acceptor acceptor(io, Endpoint(absl::GetFlag(FLAGS_listen)));
    std::printf("morse-netprobe: listening on %s\n",
                absl::GetFlag(FLAGS_listen).c_str());
    std::fflush(stdout);
    Accept(acceptor);
    io.run();
    return 0;
  }
  if (absl::GetFlag(FLAGS_connect).empty()) {
    std::fprintf(stderr,
                 "morse-netprobe: give --listen or --connect (see --help)\n");
    return 2;
  }
  const int streams = absl::GetFlag(FLAGS_streams);
  const bool both = absl::GetFlag(FLAGS_both);
  std::vector<std::shared_ptr<Pipe>> pipes;
  for (int i = 0; i < streams; ++i) {
    tcp::socket socket(io);
    boost::system::error_code error;
    const auto give_up =
        std::chrono::steady_clock::now() +
        std::chrono::duration<double>(absl::GetFlag(FLAGS_connect_seconds));
    for (;;) {
      socket.connect(Endpoint(absl::GetFlag(FLAGS_connect)), error);
      if (!error || std::chrono::steady_clock::now() >= give_up) break;
      socket.close();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (error) {
      std::fprintf(stderr, "morse-netprobe: cannot connect to %s: %s\n",
                   absl::GetFlag(FLAGS_connect).c_str(),
                   error.message().c_str());
      return 3;
    }
    socket.set_option(tcp::no_delay(true));
    const char mode = both ? 'B' : 'U';
    boost::asio::write(socket, boost::asio::buffer(&mode, 1));
    auto pipe = std::make_shared<Pipe>(std::move(socket));
    pipe->Write();
    if (both) pipe->Read();
    pipes.push_back(pipe);
  }
  const auto total = [&](bool up) {
    uint64_t n = 0;
    for (auto& p : pipes) n += up ? p->sent.load() : p->received.load();
    return n;
  };
  using Clock = std::chrono::steady_clock;
  const double warmup = absl::GetFlag(FLAGS_warmup),
               seconds = absl::GetFlag(FLAGS_seconds);
  uint64_t up0 = 0, down0 = 0;
  Clock::time_point start;
  boost::asio::steady_timer timer(io);
  timer.expires_after(
      std::chrono::microseconds(static_cast<int64_t>(warmup * 1e6)));
  timer.async_wait([&](auto) {
    up0 = total(true);
    down0 = total(false);
    start = Clock::now();
    timer.expires_after(
        std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6)));
    timer.async_wait([&](auto) { io.stop(); });
  });
  io.run();
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - start).count();
  const double up = (total(true) - up0) * 8.0 / elapsed / 1e9;
  const double down = (total(false) - down0) * 8.0 / elapsed / 1e9;
  std::printf(
      "{\"streams\":%d,\"seconds\":%.3f,\"both\":%s,\"up_gbps\":%.4f,\"down_"
      "gbps\":%.4f}\n",
      streams, elapsed, both ? "true" : "false", up, down);
  return 0;
}
