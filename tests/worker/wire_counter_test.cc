// WireCounter over real loopback TCP connections: a connection that closes
// and is replaced (a reconnect) keeps what it counted, the new one is
// counted from its first byte, and what a socket open at the start had
// moved before it is not (issue 40: the summary's wire bytes wrapped after
// a reconnect).
#include "worker/wire_counter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace morse::worker {
namespace {

// Both ends of one loopback TCP connection, in this process.
class Connection {
 public:
  Connection() {
    const int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof address;
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), len), 0);
    EXPECT_EQ(listen(listener, 1), 0);
    EXPECT_EQ(
        getsockname(listener, reinterpret_cast<sockaddr*>(&address), &len), 0);
    client_ = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client_, reinterpret_cast<sockaddr*>(&address), len), 0);
    server_ = accept(listener, nullptr, nullptr);
    EXPECT_GE(server_, 0);
    close(listener);
  }
  ~Connection() { Close(); }

  // `bytes` from the client to the server, read there in full.
  void Send(size_t bytes) {
    const std::string data(bytes, 'x');
    std::string sink(bytes, '\0');
    size_t written = 0, read = 0;
    while (read < bytes) {
      if (written < bytes) {
        const ssize_t n = write(client_, data.data() + written,
                                std::min<size_t>(bytes - written, 65536));
        ASSERT_GT(n, 0);
        written += static_cast<size_t>(n);
      }
      const ssize_t n = ::read(server_, sink.data() + read, bytes - read);
      ASSERT_GT(n, 0);
      read += static_cast<size_t>(n);
    }
  }

  void Close() {
    if (client_ >= 0) close(client_);
    if (server_ >= 0) close(server_);
    client_ = server_ = -1;
  }

 private:
  int client_ = -1, server_ = -1;
};

// Reads until the counter has seen `sent` bytes sent (their acknowledgements
// may trail the reads by a moment).
WireCounter::Bytes ReadUntil(WireCounter& counter, uint64_t sent) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  WireCounter::Bytes bytes = counter.Read();
  while (bytes.sent < sent && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
    bytes = counter.Read();
  }
  return bytes;
}

// Bytes a connection's handshake may add to the counts (the SYN's sequence
// number, on some kernels).
constexpr uint64_t kSlack = 2;

TEST(WireCounterTest, AReconnectKeepsWhatTheClosedConnectionMoved) {
  auto before = std::make_unique<Connection>();
  before->Send(300000);  // before the counter: not counted
  WireCounter counter;
  before->Send(100000);
  WireCounter::Bytes bytes = ReadUntil(counter, 100000);
  EXPECT_GE(bytes.sent, 100000u);
  EXPECT_LE(bytes.sent, 100000u + kSlack);
  EXPECT_GE(bytes.received, 100000u);
  EXPECT_LE(bytes.received, 100000u + kSlack);
  // The connection drops and another replaces it: the sum over the sockets
  // open now falls to the new one's, the counter's totals do not.
  before.reset();
  Connection after;
  after.Send(50000);
  bytes = ReadUntil(counter, 150000);
  EXPECT_GE(bytes.sent, 150000u);
  EXPECT_LE(bytes.sent, 150000u + 2 * kSlack);
  EXPECT_GE(bytes.received, 150000u);
  EXPECT_LE(bytes.received, 150000u + 2 * kSlack);
  after.Close();
  const WireCounter::Bytes closed = counter.Read();
  EXPECT_EQ(closed.sent, bytes.sent);
  EXPECT_EQ(closed.received, bytes.received);
}

TEST(WireCounterTest, NothingMovedCountsNothing) {
  Connection idle;
  WireCounter counter;
  const WireCounter::Bytes bytes = counter.Read();
  EXPECT_EQ(bytes.sent, 0u);
  EXPECT_EQ(bytes.received, 0u);
}

}  // namespace
}  // namespace morse::worker
