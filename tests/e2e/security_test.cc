// TLS, mutual TLS and bearer tokens against real morse-server and
// morse-worker processes. Certificates come from deploy/make-certs.sh at test
// time (two unrelated CAs), never from the repository.
#include "proto/security.h"

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "gtest/gtest.h"
#include "proto/morse.grpc.pb.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

constexpr char kJob[] = R"(
  workers: 2
  shards: 1
  synthetic { dim: 5000 }
  optimizer: "adam"
  adam { eps: 1e-4 }
  lr { lr: 0.01 }
  steps: 5
  block_elems: 16
  partition_elems: 1024
  timeouts { connect_seconds: 8 }
)";

std::string MakeDir() {
  char tmpl[] = "/tmp/morse-security-XXXXXX";
  return mkdtemp(tmpl);
}

void MakeCerts(const std::string& dir) {
  const std::string command =
      absl::StrCat(MORSE_SOURCE_DIR, "/deploy/make-certs.sh ", dir,
                   " localhost 127.0.0.1 >/dev/null");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeDir());
    MakeCerts(*dir_ + "/a");  // the job's CA
    MakeCerts(*dir_ + "/b");  // an unrelated CA
  }
  static std::string A(const std::string& file) { return *dir_ + "/a/" + file; }
  static std::string B(const std::string& file) { return *dir_ + "/b/" + file; }

  // A server with TLS, client certificates from CA a, and a bearer token.
  void StartSecureServer(testing::Cluster& cluster,
                         const std::string& token_file,
                         std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "--tls-cert", A("server.pem"), "--tls-key",    A("server.key"),
        "--tls-ca",   A("ca.pem"),     "--token-file", token_file};
    args.insert(args.end(), extra.begin(), extra.end());
    cluster.SetSecurity(args, {});
    cluster.StartServers(false);
  }

  // GetShardInfo over `credentials`, with `token` as bearer token if set.
  static grpc::Status Call(
      const std::string& address,
      std::shared_ptr<grpc::ChannelCredentials> credentials,
      const std::string& token, int seconds = 10,
      const std::string& second_token = "") {
    auto stub =
        v1::ParameterServer::NewStub(grpc::CreateChannel(address, credentials));
    grpc::ClientContext context;
    // Ready waits out the server's start-up; the deadline bounds a refused
    // handshake, which looks like an unreachable server (callers expecting
    // one pass a short deadline).
    context.set_wait_for_ready(true);
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(seconds));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    if (!second_token.empty())
      context.AddMetadata("authorization", "Bearer " + second_token);
    v1::ShardInfo info;
    return stub->GetShardInfo(&context, v1::ShardInfoRequest(), &info);
  }

  // TLS credentials trusting `ca`, presenting `cert`/`key` if given.
  static std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca,
                                                       const std::string& cert,
                                                       const std::string& key) {
    proto::SecurityOptions o;
    o.tls_ca = ca;
    o.tls_cert = cert;
    o.tls_key = key;
    o.refresh_seconds = 1;
    return proto::MakeChannelCredentials(o);
  }

  static std::string Token() {
    return testing::ReadFile(A("token")).substr(0, 64);
  }

  static std::string* dir_;
};

std::string* SecurityTest::dir_ = nullptr;

TEST_F(SecurityTest, CorrectClientIsAcceptedAndWrongOnesAreRefused) {
  testing::Cluster cluster(kJob, 1, 0);
  StartSecureServer(cluster, A("token"));
  const std::string address = cluster.server_address(0);
  const auto good = Tls(A("ca.pem"), A("client.pem"), A("client.key"));

  grpc::Status s = Call(address, good, Token());
  EXPECT_TRUE(s.ok()) << s.error_message()
                      << testing::ReadFile(cluster.server_log(0));

  s = Call(address, good, "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  EXPECT_NE(s.error_message().find("missing bearer token"), std::string::npos);

  s = Call(address, good, Token() + "x");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  // The same length, the first character changed.
  s = Call(address, good, (Token()[0] == '0' ? "1" : "0") + Token().substr(1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  // Exactly one token: a second header, even a correct one, is refused.
  s = Call(address, good, Token(), 10, Token());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  EXPECT_NE(s.error_message().find("more than one"), std::string::npos);

  // A client certificate from another CA fails the handshake.
  s = Call(address, Tls(A("ca.pem"), B("client.pem"), B("client.key")), Token(),
           2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  // So does no client certificate at all.
  s = Call(address, Tls(A("ca.pem"), "", ""), Token(), 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  // A client that trusts another CA refuses the server.
  s = Call(address, Tls(B("ca.pem"), A("client.pem"), A("client.key")), Token(),
           2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  // Plaintext against TLS fails.
  s = Call(address, grpc::InsecureChannelCredentials(), Token(), 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();

  // Still serving the right client after all that.
  s = Call(address, good, Token());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(SecurityTest, WorkersTrainOverMutualTlsWithToken) {
  testing::Cluster cluster(kJob, 1, 2);
  StartSecureServer(cluster, A("token"));
  cluster.SetSecurity(
      {}, {"--tls_ca", A("ca.pem"), "--tls_cert", A("client.pem"), "--tls_key",
           A("client.key"), "--token_file", A("token")});
  cluster.StartWorkers(false);
  std::string failure;
  EXPECT_TRUE(cluster.WaitWorkers(absl::Seconds(60), &failure)) << failure;
}

TEST_F(SecurityTest, WorkerWithWrongTokenStopsWithPermanentError) {
  testing::Cluster cluster(kJob, 1, 2);
  StartSecureServer(cluster, A("token"));
  WriteFile(cluster.dir() + "/wrong", "not-the-token\n");
  cluster.SetSecurity(
      {}, {"--tls_ca", A("ca.pem"), "--tls_cert", A("client.pem"), "--tls_key",
           A("client.key"), "--token_file", cluster.dir() + "/wrong"});
  cluster.StartWorker(0, false);
  std::string failure;
  EXPECT_FALSE(cluster.WaitWorkers(absl::Seconds(30), &failure));
  EXPECT_NE(failure.find("exited 2:"), std::string::npos) << failure;
  EXPECT_NE(
      testing::ReadFile(cluster.worker_log(0)).find("invalid bearer token"),
      std::string::npos);
}

// Per-rank identity: with make-certs.sh --workers, the servers' token file
// ties each token to a rank; workers find theirs through token-{rank}. A
// worker presenting another rank's token is refused with PERMISSION_DENIED
// (exit 2) and the shard accepts no push from it.
TEST_F(SecurityTest, PerRankTokensStopImpostors) {
  const std::string c = *dir_ + "/c";
  const std::string command =
      absl::StrCat(MORSE_SOURCE_DIR, "/deploy/make-certs.sh --workers 2 ", c,
                   " localhost 127.0.0.1 >/dev/null");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto tls = [&](const std::string& token) {
    return std::vector<std::string>{
        "--tls_ca",  c + "/ca.pem",     "--tls_cert",   c + "/client.pem",
        "--tls_key", c + "/client.key", "--token_file", token};
  };
  {
    testing::Cluster cluster(kJob, 1, 2);
    cluster.SetSecurity(
        {"--tls-cert", c + "/server.pem", "--tls-key", c + "/server.key",
         "--tls-ca", c + "/ca.pem", "--token-file", c + "/tokens"},
        tls(c + "/token-{rank}"));
    cluster.StartServers(false);
    cluster.StartWorkers(false);
    std::string failure;
    EXPECT_TRUE(cluster.WaitWorkers(absl::Seconds(60), &failure)) << failure;
  }
  testing::Cluster cluster(kJob, 1, 0);
  cluster.SetSecurity(
      {"--tls-cert", c + "/server.pem", "--tls-key", c + "/server.key",
       "--tls-ca", c + "/ca.pem", "--token-file", c + "/tokens"},
      tls(c + "/token-0"));  // rank 1 with rank 0's token
  cluster.StartServers(false);
  cluster.StartWorker(1, false);
  std::string failure;
  EXPECT_FALSE(cluster.WaitWorkers(absl::Seconds(30), &failure));
  EXPECT_NE(failure.find("exited 2:"), std::string::npos) << failure;
  EXPECT_NE(testing::ReadFile(cluster.worker_log(1))
                .find("is rank 0's; it cannot act as rank 1"),
            std::string::npos)
      << testing::ReadFile(cluster.worker_log(1));
  // Rank 0's token still reads what needs no rank (shard info).
  EXPECT_TRUE(Call(cluster.server_address(0),
                   Tls(c + "/ca.pem", c + "/client.pem", c + "/client.key"),
                   testing::ReadFile(c + "/token-0").substr(0, 64))
                  .ok());
}

TEST_F(SecurityTest, DaemonsRefuseToStartWithoutCredentials) {
  testing::Cluster cluster(kJob, 1, 0);
  testing::Process server(
      {testing::ServerBin(), "--config", cluster.config_path(), "--shard", "0",
       "--listen", "127.0.0.1:0"},
      cluster.dir() + "/server.log");
  int code = -1;
  ASSERT_TRUE(server.Wait(absl::Seconds(20), &code));
  EXPECT_EQ(code, 2);
  const std::string log = testing::ReadFile(cluster.dir() + "/server.log");
  EXPECT_NE(log.find("--tls_cert"), std::string::npos) << log;
  EXPECT_NE(log.find("--insecure"), std::string::npos) << log;

  testing::Process worker(
      {testing::WorkerBin(), "--config", cluster.config_path(), "--rank", "0",
       "--servers", "127.0.0.1:1", "--token_file", A("token")},
      cluster.dir() + "/worker.log");
  ASSERT_TRUE(worker.Wait(absl::Seconds(20), &code));
  EXPECT_EQ(code, 2);
  EXPECT_NE(testing::ReadFile(cluster.dir() + "/worker.log").find("--tls_ca"),
            std::string::npos);

  // Unreadable or non-PEM files are refused at start too.
  testing::Process bad(
      {testing::ServerBin(), "--config", cluster.config_path(), "--shard", "0",
       "--listen", "127.0.0.1:0", "--tls_cert", A("token"), "--tls_key",
       A("server.key"), "--token_file", A("token")},
      cluster.dir() + "/bad.log");
  ASSERT_TRUE(bad.Wait(absl::Seconds(20), &code));
  EXPECT_EQ(code, 2);
  EXPECT_NE(testing::ReadFile(cluster.dir() + "/bad.log")
                .find("holds no PEM CERTIFICATE"),
            std::string::npos);
}

TEST_F(SecurityTest, TokenIsCheckedOnPlaintextToo) {
  // gRPC's AuthMetadataProcessor aborts on insecure credentials; the token
  // check lives in the service, so --insecure with a token still enforces it.
  testing::Cluster cluster(kJob, 1, 0);
  cluster.SetSecurity({"--insecure", "--token_file", A("token")}, {});
  cluster.StartServers(false);
  const auto plain = grpc::InsecureChannelCredentials();
  EXPECT_EQ(Call(cluster.server_address(0), plain, "").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(cluster.server_address(0), plain, "wrong").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Call(cluster.server_address(0), plain, Token()).ok());
}

TEST_F(SecurityTest, TokenAndCertificateRotationWithoutRestart) {
  testing::Cluster cluster(kJob, 1, 0);
  // Copies the server's credentials into the job directory so they can change.
  const std::string d = cluster.dir();
  for (const char* f : {"server.pem", "server.key", "ca.pem"}) {
    WriteFile(absl::StrCat(d, "/", f), testing::ReadFile(A(f)));
  }
  WriteFile(d + "/token", "old-token\n");
  cluster.SetSecurity(
      {"--tls_cert", d + "/server.pem", "--tls_key", d + "/server.key",
       "--tls_ca", d + "/ca.pem", "--token_file", d + "/token",
       "--tls_refresh_seconds", "1"},
      {});
  cluster.StartServers(false);
  const std::string address = cluster.server_address(0);
  const auto a_client = Tls(A("ca.pem"), A("client.pem"), A("client.key"));
  ASSERT_TRUE(Call(address, a_client, "old-token").ok());

  // Token rotation: both during the overlap, then only the new one.
  WriteFile(d + "/token", "new-token\nold-token\n");
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(Call(address, a_client, "new-token").ok());
  EXPECT_TRUE(Call(address, a_client, "old-token").ok());
  WriteFile(d + "/token", "new-token\n");
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(Call(address, a_client, "old-token").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Call(address, a_client, "new-token").ok());

  // Certificate rotation: the server moves to CA b's identity and trusts
  // CA b's clients. New connections from b's clients succeed; a's fail.
  for (const char* f : {"server.pem", "server.key", "ca.pem"}) {
    WriteFile(absl::StrCat(d, "/", f), testing::ReadFile(B(f)));
  }
  absl::SleepFor(absl::Milliseconds(2500));
  const auto b_client = Tls(B("ca.pem"), B("client.pem"), B("client.key"));
  EXPECT_TRUE(Call(address, b_client, "new-token").ok());
  EXPECT_EQ(Call(address, Tls(A("ca.pem"), A("client.pem"), A("client.key")),
                 "new-token", 2)
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(proto::ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(proto::ConstantTimeEquals("", ""));
  EXPECT_FALSE(proto::ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(proto::ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(proto::ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(proto::ConstantTimeEquals(std::string("a\0", 2), "a"));
}

}  // namespace
}  // namespace morse
