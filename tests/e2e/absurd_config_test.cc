// Configs no host can run, given to the real daemons (issue 14): absurd
// sizes and timeouts end with exit 2 and a message naming the field or the
// memory, never with std::bad_alloc, a crash or a job that fails every RPC.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

struct Outcome {
  int exit_code = -1;
  std::string log;
};

Outcome RunToExit(const std::string& dir, std::vector<std::string> argv) {
  const std::string log = dir + "/run.log";
  testing::Process p(argv, log);
  Outcome out;
  EXPECT_TRUE(p.Wait(absl::Seconds(30), &out.exit_code))
      << argv[0] << " did not exit";
  out.log = testing::ReadFile(log);
  return out;
}

class AbsurdConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/absurd_config_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
  }
  std::string Write(const std::string& text) {
    const std::string path = dir_ + "/job.textproto";
    std::ofstream(path) << text;
    return path;
  }
  Outcome Server(const std::string& config,
                 std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {
        testing::ServerBin(),
        "--config",
        Write(config),
        "--shard",
        "0",
        "--insecure",
        "--listen",
        "127.0.0.1:" + std::to_string(testing::FreePort())};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunToExit(dir_, argv);
  }
  // morse-worker --check_config on `config` with `extra` flags.
  Outcome WorkerCheck(const std::string& config,
                      std::vector<std::string> extra) {
    std::vector<std::string> argv = {testing::WorkerBin(), "--config",
                                     Write(config), "--insecure",
                                     "--check_config"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunToExit(dir_, argv);
  }
  Outcome WorkerCheck(const std::string& config) {
    return WorkerCheck(config, {"--rank", "0", "--servers", "127.0.0.1:1"});
  }
  std::string dir_;
};

constexpr char kBase[] = "shards: 1 lr { lr: 0.01 } steps: 10 freeze_step: 2 ";

TEST_F(AbsurdConfigTest, AModelNoHostCanHoldIsRefusedBeforeAllocating) {
  // 10^12 elements: 16 TB of shard state and of worker state.
  const std::string config =
      std::string(kBase) + "workers: 1 synthetic { dim: 1000000000000 }";
  for (const Outcome& o : {Server(config), Server(config, {"--check_config"}),
                           WorkerCheck(config)}) {
    EXPECT_EQ(o.exit_code, 2) << o.log;
    EXPECT_NE(o.log.find("GiB of state but this host has"), std::string::npos)
        << o.log;
    EXPECT_EQ(o.log.find("bad_alloc"), std::string::npos) << o.log;
  }
}

TEST_F(AbsurdConfigTest, AbsurdCountsAndTimeoutsNameTheirField) {
  const struct {
    std::string config;
    std::string field;
  } cases[] = {
      {std::string(kBase) + "workers: 4294967295 synthetic { dim: 1000 }",
       "workers"},
      {std::string(kBase) +
           "workers: 1 synthetic { dim: 1000 } timeouts { step_seconds: inf }",
       "timeouts.step_seconds"},
      {std::string(kBase) +
           "workers: 1 synthetic { dim: 1000 } timeouts { rpc_seconds: 1e12 }",
       "timeouts.rpc_seconds"},
      {std::string(kBase) + "workers: 1 synthetic { dim: 1000 } timeouts { "
                            "connect_seconds: -1 }",
       "timeouts.connect_seconds"},
  };
  for (const auto& c : cases) {
    for (const Outcome& o : {Server(c.config), WorkerCheck(c.config)}) {
      EXPECT_EQ(o.exit_code, 2) << c.config << "\n" << o.log;
      EXPECT_NE(o.log.find(c.field), std::string::npos) << c.config << "\n"
                                                        << o.log;
    }
  }
}

// A folder, an empty file or a missing file given as --config: both daemons
// exit 2 saying which, not that a field the user never wrote is wrong.
TEST_F(AbsurdConfigTest, AConfigFileThatHoldsNoConfigSaysWhy) {
  const std::string empty = dir_ + "/empty.textproto";
  std::ofstream(empty) << "\n";
  const struct {
    std::string path;
    std::string why;
  } cases[] = {{dir_, "is a directory"},
               {empty, "is empty"},
               {dir_ + "/missing.textproto", "No such file or directory"}};
  for (const auto& c : cases) {
    for (const Outcome& o :
         {RunToExit(dir_, {testing::ServerBin(), "--config", c.path, "--shard",
                           "0", "--insecure"}),
          RunToExit(dir_, {testing::WorkerBin(), "--config", c.path, "--rank",
                           "0", "--insecure", "--check_config"})}) {
      EXPECT_EQ(o.exit_code, 2) << c.path << "\n" << o.log;
      EXPECT_NE(o.log.find(c.why), std::string::npos) << c.path << "\n"
                                                      << o.log;
    }
  }
}

// --shard left out, or out of the job's range, names the range.
TEST_F(AbsurdConfigTest, AShardOutsideTheJobNamesTheRange) {
  const std::string config =
      std::string(kBase) + "workers: 1 synthetic { dim: 1000 }";
  const Outcome missing = RunToExit(
      dir_, {testing::ServerBin(), "--config", Write(config), "--insecure"});
  EXPECT_EQ(missing.exit_code, 2) << missing.log;
  EXPECT_NE(missing.log.find("--shard is required: 0..0 (the job has 1 "
                             "shards)"),
            std::string::npos)
      << missing.log;
  for (const std::string shard : {"-3", "1"}) {
    const Outcome o = Server(config, {"--shard", shard});
    EXPECT_EQ(o.exit_code, 2) << shard << "\n" << o.log;
    EXPECT_NE(o.log.find("--shard " + shard + ":"), std::string::npos) << o.log;
  }
}

// The same for a worker's --rank, and a --servers list of the wrong length
// says how many it lists and how many the job has.
TEST_F(AbsurdConfigTest, ARankOutsideTheJobNamesTheRange) {
  const std::string config =
      std::string(kBase) + "workers: 2 synthetic { dim: 1000 }";
  const auto worker = [&](std::vector<std::string> extra) {
    return WorkerCheck(config, std::move(extra));
  };
  const Outcome missing = worker({"--servers", "127.0.0.1:7000"});
  const Outcome negative = worker({"--rank", "-3"});
  const Outcome beyond = worker({"--rank", "2"});
  const Outcome servers =
      worker({"--rank", "1", "--servers", "127.0.0.1:7000,127.0.0.1:7001"});
  for (const auto& [o, said] :
       {std::pair{missing, "--rank is required: 0..1 (the job has 2 workers)"},
        std::pair{negative, "--rank -3: must be in 0..1"},
        std::pair{beyond, "--rank 2: must be in 0..1"},
        std::pair{servers,
                  "--servers lists 2 addresses; the job has 1 shard"}}) {
    EXPECT_EQ(o.exit_code, 2) << o.log;
    EXPECT_NE(o.log.find(said), std::string::npos) << o.log;
  }
}

// Addresses that are not HOST:PORT end both daemons with exit 2 naming the
// flag: gRPC would serve "127.0.0.1:99999" on port 34463, and a worker given
// a shard's address without a port waited for it forever.
TEST_F(AbsurdConfigTest, AnAddressThatIsNotHostPortIsRefused) {
  const std::string config =
      std::string(kBase) + "workers: 1 synthetic { dim: 1000 }";
  const Outcome listen = Server(config, {"--listen", "127.0.0.1:99999"});
  const Outcome metrics = Server(config, {"--metrics_listen", "nonsense"});
  const Outcome worker =
      RunToExit(dir_, {testing::WorkerBin(), "--config", Write(config),
                       "--rank", "0", "--servers", "shard-0", "--insecure"});
  for (const auto& [o, said] :
       {std::pair{listen, "--listen '127.0.0.1:99999' is not HOST:PORT"},
        std::pair{metrics, "--metrics_listen 'nonsense' is not HOST:PORT"},
        std::pair{worker, "shard 0's address 'shard-0' is not HOST:PORT"}}) {
    EXPECT_EQ(o.exit_code, 2) << o.log;
    EXPECT_NE(o.log.find(said), std::string::npos) << o.log;
  }
}

// --check_config says what the daemon would refuse at its start: the
// addresses, the worker's --device, the server's TLS policy (the manifests'
// checks run it: docs/deploy.md).
TEST_F(AbsurdConfigTest, CheckConfigRefusesWhatTheStartWould) {
  const std::string config =
      std::string(kBase) + "workers: 1 synthetic { dim: 1000 }";
  const Outcome listen =
      Server(config, {"--listen", "127.0.0.1:99999", "--check_config"});
  const Outcome health =
      Server(config, {"--health_listen", "nonsense", "--check_config"});
  const auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"--rank", "0"});
    return WorkerCheck(config, std::move(extra));
  };
  const Outcome address = with({"--servers", "127.0.0.1"});
  const Outcome device =
      with({"--servers", "127.0.0.1:7000", "--device", "gpu"});
  const Outcome metrics =
      with({"--servers", "127.0.0.1:7000", "--metrics_listen", "127.0.0.1:x"});
  for (const auto& [o, said] :
       {std::pair{listen, "--listen '127.0.0.1:99999' is not HOST:PORT"},
        std::pair{health, "--health_listen 'nonsense' is not HOST:PORT"},
        std::pair{address, "shard 0's address '127.0.0.1' is not HOST:PORT"},
        std::pair{device, "--device gpu: use auto, cpu or cuda"},
        std::pair{metrics,
                  "--metrics_listen '127.0.0.1:x' is not HOST:PORT"}}) {
    EXPECT_EQ(o.exit_code, 2) << o.log;
    EXPECT_NE(o.log.find(said), std::string::npos) << o.log;
    EXPECT_EQ(o.log.find("config OK"), std::string::npos) << o.log;
  }
  // And passes what it would start with.
  const Outcome ok = with({"--servers", "127.0.0.1:7000", "--device", "cpu"});
  EXPECT_EQ(ok.exit_code, 0) << ok.log;
  EXPECT_NE(ok.log.find("config OK"), std::string::npos) << ok.log;
}

}  // namespace
}  // namespace morse
