// morse-server --metrics_listen: /metrics in the Prometheus text format with
// counters that move as a short job runs, /healthz and /readyz; promtool
// (Debian's prometheus package) accepts the output when it is installed.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

// A GET over plain HTTP/1.0; returns status line + headers + body.
std::string Get(int port, const std::string& path) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket socket(io);
  boost::system::error_code error;
  socket.connect({boost::asio::ip::make_address("127.0.0.1"),
                  static_cast<unsigned short>(port)},
                 error);
  if (error) return "";
  const std::string request =
      "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  boost::asio::write(socket, boost::asio::buffer(request), error);
  std::string response;
  char buffer[4096];
  while (true) {
    const size_t n = socket.read_some(boost::asio::buffer(buffer), error);
    response.append(buffer, n);
    if (error) break;
  }
  return response;
}

// promtool (Debian's prometheus package) accepts the body of an HTTP
// response from /metrics; skipped, saying so, when promtool is missing.
void ExpectPromtoolAccepts(const std::string& response,
                           const std::string& dir) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    std::printf("promtool not installed: the format check is skipped\n");
    return;
  }
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  const std::string path = dir + "/metrics.txt";
  std::ofstream(path) << body;
  EXPECT_EQ(std::system(("promtool check metrics < " + path).c_str()), 0)
      << body;
}

double Value(const std::string& text, const std::string& metric,
             const std::string& label) {
  size_t at = 0;
  while ((at = text.find(metric + "{", at)) != std::string::npos) {
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    if (line.find(label) != std::string::npos)
      return std::atof(line.substr(line.rfind(' ') + 1).c_str());
    at = end;
  }
  return -1;
}

TEST(MetricsTest, CountersMoveAndTheFormatIsPrometheus) {
  const int port = testing::FreePort();
  const std::string config = R"(
    workers: 2
    shards: 1
    synthetic { dim: 20011 }
    lr { lr: 0.01 }
    steps: 6
    freeze_step: 2
    block_elems: 256
    partition_elems: 4096
  )";
  testing::Cluster cluster(config, 1, 2);
  cluster.AddServerArgs({absl::StrCat("--metrics_listen=127.0.0.1:", port)});
  cluster.StartServers(false);
  std::string health;
  for (int i = 0; i < 100 && health.empty(); ++i) {
    health = Get(port, "/healthz");
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(health.find("200 OK"), std::string::npos) << health;
  EXPECT_NE(Get(port, "/readyz").find("503"),
            std::string::npos);  // no parameters yet
  cluster.StartWorkers(false);
  std::string failure;
  ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(60), &failure)) << failure;
  EXPECT_NE(Get(port, "/readyz").find("200 OK"), std::string::npos);
  const std::string metrics = Get(port, "/metrics");
  // 5 partitions x 2 workers x 6 steps.
  EXPECT_EQ(Value(metrics, "morse_server_pushes_total", "code=\"OK\""), 60)
      << metrics;
  EXPECT_EQ(Value(metrics, "morse_server_steps_total", "shard=\"0\""), 6);
  EXPECT_EQ(Value(metrics, "morse_server_workers_joined", "shard=\"0\""), 2);
  // Every worker in every step's membership (the job is not elastic).
  EXPECT_EQ(Value(metrics, "morse_server_members", "shard=\"0\""), 2);
  EXPECT_EQ(Value(metrics, "morse_server_workers_dropped_total", "shard=\"0\""),
            0);
  EXPECT_GT(
      Value(metrics, "morse_server_received_bytes_total", "codec=\"sign1\""),
      0);
  EXPECT_GT(Value(metrics, "morse_server_sent_bytes_total", "codec=\"fp32\""),
            0);
  EXPECT_NE(metrics.find("# TYPE morse_server_step_seconds histogram"),
            std::string::npos);
  EXPECT_NE(Get(port, "/nope").find("404"), std::string::npos);
  ExpectPromtoolAccepts(metrics, cluster.dir());
}

}  // namespace
}  // namespace morse

namespace morse {
namespace {

TEST(MetricsTest, AWorkerServesItsMetricsWhileItTrains) {
  const int port = testing::FreePort();
  const std::string config = R"(
    workers: 1
    shards: 1
    synthetic { dim: 5000 }
    lr { lr: 0.001 }
    steps: 1000000
    freeze_step: 3
    block_elems: 256
    partition_elems: 1024
    log_every: 5
  )";
  testing::Cluster cluster(config, 1, 1);
  cluster.AddWorkerArgs({absl::StrCat("--metrics_listen=127.0.0.1:", port)});
  cluster.StartServers(false);
  cluster.StartWorkers(false);  // runs until the cluster is torn down
  double steps = -1;
  std::string metrics;
  for (int i = 0; i < 300 && steps < 10; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    metrics = Get(port, "/metrics");
    steps = Value(metrics, "morse_worker_steps_total", "rank=\"0\"");
  }
  ASSERT_GE(steps, 10) << metrics << testing::ReadFile(cluster.worker_log(0));
  EXPECT_NE(Get(port, "/readyz").find("200 OK"), std::string::npos);
  EXPECT_NE(Get(port, "/healthz").find("200 OK"), std::string::npos);
  EXPECT_GT(
      Value(metrics, "morse_worker_payload_bytes_total", "direction=\"up\""), 0)
      << metrics;
  EXPECT_GT(Value(metrics, "morse_worker_wire_bytes_total", "direction=\"up\""),
            0)
      << metrics;
  EXPECT_GT(
      Value(metrics, "morse_worker_wire_bytes_total", "direction=\"down\""), 0)
      << metrics;
  EXPECT_NE(metrics.find("morse_worker_communication_seconds_count"),
            std::string::npos);
  EXPECT_NE(metrics.find("morse_worker_loss{"), std::string::npos);
  ExpectPromtoolAccepts(metrics, cluster.dir());
}

}  // namespace
}  // namespace morse
