// Convergence through the real daemons on the real digits data: 1-bit Adam
// with a 20% warmup reaches test accuracy within 1 point of fp32 Adam after
// the same number of steps (the quickstart's two jobs).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace morse {
namespace {

using testing::Cluster;
using testing::JsonField;
using testing::ReadFile;

double TrainDigits(const std::string& config_name, const std::string& data_dir) {
  std::string config = ReadFile(absl::StrCat(MORSE_SOURCE_DIR, "/deploy/configs/", config_name));
  EXPECT_FALSE(config.empty()) << config_name;
  config = absl::StrReplaceAll(config, {{"data/digits", data_dir}});
  Cluster cluster(config, 2, 4);
  cluster.StartServers(false);
  cluster.StartWorkers(false);
  std::string failure;
  EXPECT_TRUE(cluster.WaitWorkers(absl::Seconds(300), &failure)) << failure;
  const auto accuracy = JsonField(ReadFile(cluster.worker_log(0)), "test_accuracy");
  EXPECT_EQ(accuracy.size(), 1u) << ReadFile(cluster.worker_log(0));
  return accuracy.empty() ? 0.0 : std::atof(accuracy[0].c_str());
}

TEST(DigitsTest, OneBitAdamIsWithinAPointOfAdam) {
  char pattern[] = "/tmp/morse-digits-XXXXXX";
  const std::string data_dir = mkdtemp(pattern);
  const std::string prep = absl::StrCat("/usr/bin/python3 ", MORSE_SOURCE_DIR,
                                        "/deploy/data/digits.py ", data_dir);
  ASSERT_EQ(std::system(prep.c_str()), 0)
      << "could not write the digits data set (needs python3-sklearn; tests/run.sh installs it)";
  const double adam = TrainDigits("digits_adam.textproto", data_dir);
  const double onebit = TrainDigits("digits_onebit_adam.textproto", data_dir);
  // 1-bit LAMB with the MLP's weight matrices and bias vectors as layers.
  const double lamb = TrainDigits("digits_onebit_lamb.textproto", data_dir);
  std::printf("digits, 500 steps, 4 workers, 2 shards: test accuracy adam %.2f%%, onebit_adam %.2f%%, "
              "onebit_lamb %.2f%%\n",
              100 * adam, 100 * onebit, 100 * lamb);
  EXPECT_GT(adam, 0.95);
  EXPECT_GE(onebit, adam - 0.01);
  EXPECT_GE(lamb, adam - 0.01);
  std::system(absl::StrCat("rm -rf ", data_dir).c_str());
}

}  // namespace
}  // namespace morse
