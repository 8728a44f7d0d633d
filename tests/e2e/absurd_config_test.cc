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
  Outcome WorkerCheck(const std::string& config) {
    return RunToExit(
        dir_, {testing::WorkerBin(), "--config", Write(config), "--rank", "0",
               "--servers", "127.0.0.1:1", "--insecure", "--check_config"});
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

}  // namespace
}  // namespace morse
