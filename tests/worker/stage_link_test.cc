// StageLink over real loopback sockets: frames both ways in order, and every
// way a peer can fail (closed, refused, silent, unauthenticated, absent)
// ending in a clear status instead of a hang.
#include "worker/stage_link.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace morse::worker {
namespace {

struct Pair {
  std::unique_ptr<StageLink> later, earlier;
};

Pair Connected(const proto::SecurityOptions& server = proto::Insecure(),
               const proto::SecurityOptions& client = proto::Insecure()) {
  auto later = StageLink::Listen("127.0.0.1:0", server);
  EXPECT_TRUE(later.ok()) << later.status();
  auto earlier =
      StageLink::Connect((*later)->address(), client, absl::Seconds(10));
  EXPECT_TRUE(earlier.ok()) << earlier.status();
  return {*std::move(later), *std::move(earlier)};
}

StageFrame Frame(uint32_t kind, std::string meta, std::string payload = "") {
  StageFrame f;
  f.kind = kind;
  f.meta = std::move(meta);
  f.payload = std::move(payload);
  return f;
}

TEST(StageLinkTest, FramesFlowBothWaysInOrder) {
  Pair p = Connected();
  ASSERT_TRUE(p.earlier->Send(Frame(StageFrame::kHello, "hi")).ok());
  ASSERT_TRUE(p.later->Accept(absl::Seconds(10)).ok());
  const std::string big(
      3 << 20,
      'x');  // bigger than gRPC's default 4 MiB limit once framed twice
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(
        p.earlier
            ->Send(Frame(StageFrame::kForward, std::to_string(i), big + big))
            .ok());
  }
  auto hello = p.later->Receive(absl::Seconds(10));
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->meta, "hi");
  for (int i = 0; i < 5; ++i) {
    auto f = p.later->Receive(absl::Seconds(10));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->kind, StageFrame::kForward);
    EXPECT_EQ(f->meta, std::to_string(i));
    EXPECT_EQ(f->payload.size(), 2 * big.size());
    ASSERT_TRUE(
        p.later->Send(Frame(StageFrame::kBackward, "g" + std::to_string(i)))
            .ok());
  }
  for (int i = 0; i < 5; ++i) {
    auto f = p.earlier->Receive(absl::Seconds(10));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->meta, "g" + std::to_string(i));
  }
  EXPECT_GT(p.earlier->bytes_sent(), 10 * big.size());
  EXPECT_EQ(p.earlier->bytes_sent(), p.later->bytes_received());
  EXPECT_EQ(p.later->bytes_sent(), p.earlier->bytes_received());
}

TEST(StageLinkTest, APeerThatClosesEndsTheOthersReceive) {
  Pair p = Connected();
  ASSERT_TRUE(p.earlier->Send(Frame(StageFrame::kHello, "")).ok());
  ASSERT_TRUE(p.later->Accept(absl::Seconds(10)).ok());
  ASSERT_TRUE(p.later->Receive(absl::Seconds(10)).ok());
  p.later->Close();
  const absl::Time start = absl::Now();
  auto f = p.earlier->Receive(absl::Seconds(60));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
  EXPECT_NE(f.status().message().find("next stage"), std::string::npos)
      << f.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));

  Pair q = Connected();
  ASSERT_TRUE(q.earlier->Send(Frame(StageFrame::kHello, "")).ok());
  ASSERT_TRUE(q.later->Receive(absl::Seconds(10)).ok());
  q.earlier->Close();
  auto g = q.later->Receive(absl::Seconds(60));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
  EXPECT_NE(g.status().message().find("previous stage"), std::string::npos)
      << g.status();
}

TEST(StageLinkTest, SilenceIsADeadlineNotAHang) {
  Pair p = Connected();
  ASSERT_TRUE(p.earlier->Send(Frame(StageFrame::kHello, "")).ok());
  auto f = p.earlier->Receive(absl::Milliseconds(300));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded)
      << f.status();
}

TEST(StageLinkTest, ASecondPreviousStageIsRefused) {
  Pair p = Connected();
  ASSERT_TRUE(p.earlier->Send(Frame(StageFrame::kHello, "")).ok());
  ASSERT_TRUE(p.later->Accept(absl::Seconds(10)).ok());
  auto intruder = StageLink::Connect(p.later->address(), proto::Insecure(),
                                     absl::Seconds(10));
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  (void)(*intruder)->Send(Frame(StageFrame::kHello, "me too"));
  auto f = (*intruder)->Receive(absl::Seconds(10));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
  EXPECT_NE(f.status().message().find("already has its previous stage"),
            std::string::npos)
      << f.status();
  // The first stream is untouched.
  ASSERT_TRUE(p.later->Send(Frame(StageFrame::kBackward, "still here")).ok());
  auto g = p.earlier->Receive(absl::Seconds(10));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->meta, "still here");
}

TEST(StageLinkTest, TokensAreCheckedWhenTheStreamOpens) {
  const std::string dir = ::testing::TempDir();
  const std::string server_tokens = dir + "/stage_tokens",
                    client_token = dir + "/stage_token";
  std::ofstream(server_tokens) << "s3cret\n";
  std::ofstream(client_token) << "wrong\n";
  proto::SecurityOptions server = proto::Insecure(), client = proto::Insecure();
  server.token_file = server_tokens;
  client.token_file = client_token;
  Pair p = Connected(server, client);
  (void)p.earlier->Send(Frame(StageFrame::kHello, ""));
  auto f = p.earlier->Receive(absl::Seconds(10));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
  EXPECT_NE(f.status().message().find("UNAUTHENTICATED"), std::string::npos)
      << f.status();
  EXPECT_EQ(p.later->Accept(absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);

  client.token_file = server_tokens;
  Pair q = Connected(server, client);
  ASSERT_TRUE(q.earlier->Send(Frame(StageFrame::kHello, "ok")).ok());
  auto g = q.later->Receive(absl::Seconds(10));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->meta, "ok");
}

// Mutual TLS with deploy/make-certs.sh's files: the job's certificates
// connect; a stage without a client certificate does not.
TEST(StageLinkTest, MutualTlsWithTheJobsCertificates) {
  const std::string dir = ::testing::TempDir() + "/stage_link_certs";
  const std::string command = std::string("rm -rf ") + dir + " && " +
                              MORSE_SOURCE_DIR + "/deploy/make-certs.sh " +
                              dir + " localhost 127.0.0.1 >/dev/null";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  proto::SecurityOptions server, client;
  server.tls_cert = dir + "/server.pem";
  server.tls_key = dir + "/server.key";
  server.tls_ca =
      dir + "/ca.pem";  // clients must present a certificate of this CA
  client.tls_ca = dir + "/ca.pem";
  client.tls_cert = dir + "/client.pem";
  client.tls_key = dir + "/client.key";
  client.tls_server_name = "localhost";
  Pair p = Connected(server, client);
  ASSERT_TRUE(p.earlier->Send(Frame(StageFrame::kHello, "over tls")).ok());
  auto f = p.later->Receive(absl::Seconds(10));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->meta, "over tls");

  auto later = StageLink::Listen("127.0.0.1:0", server);
  ASSERT_TRUE(later.ok()) << later.status();
  proto::SecurityOptions anonymous = client;
  anonymous.tls_cert.clear();
  anonymous.tls_key.clear();
  anonymous.token_file =
      dir + "/token";  // a token, but the server asks for a certificate
  auto earlier =
      StageLink::Connect((*later)->address(), anonymous, absl::Seconds(3));
  if (earlier.ok()) {
    (void)(*earlier)->Send(Frame(StageFrame::kHello, ""));
    EXPECT_EQ((*earlier)->Receive(absl::Seconds(10)).status().code(),
              absl::StatusCode::kUnavailable);
  } else {
    EXPECT_EQ(earlier.status().code(), absl::StatusCode::kUnavailable)
        << earlier.status();
  }
  EXPECT_EQ((*later)->Accept(absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(StageLinkTest, NobodyListeningIsUnavailableWithinTheTimeout) {
  auto probe = StageLink::Listen("127.0.0.1:0", proto::Insecure());
  ASSERT_TRUE(probe.ok());
  const std::string address = (*probe)->address();
  probe->reset();  // the port is free again
  const absl::Time start = absl::Now();
  auto link = StageLink::Connect(address, proto::Insecure(), absl::Seconds(1));
  EXPECT_EQ(link.status().code(), absl::StatusCode::kUnavailable)
      << link.status();
  EXPECT_NE(link.status().message().find(address), std::string::npos)
      << link.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace morse::worker
