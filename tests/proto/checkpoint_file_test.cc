#include "proto/checkpoint_file.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace morse::proto {
namespace {

class CheckpointFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/morse-ckfile-XXXXXX";
    dir_ = mkdtemp(pattern);
    path_ = dir_ + "/a.ckpt";
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }
  std::string Bytes() {
    std::ifstream in(path_, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  void Overwrite(const std::string& bytes) {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
  }
  std::string dir_, path_;
};

TEST_F(CheckpointFileTest, RoundTrip) {
  CheckpointWriter writer({"shard", 3, 11, 22, 40});
  writer.AddFloats("x", std::vector<float>{1.5f, -2.0f, 0.0f});
  writer.AddInts("steps", std::vector<int64_t>{40, 40});
  ASSERT_TRUE(writer.Write(path_).ok());
  auto reader = CheckpointReader::Open(path_);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->header().kind, "shard");
  EXPECT_EQ(reader->header().index, 3u);
  EXPECT_EQ(reader->header().layout_fingerprint, 11u);
  EXPECT_EQ(reader->header().algorithm_fingerprint, 22u);
  EXPECT_EQ(reader->header().step, 40);
  EXPECT_EQ(*reader->Floats("x", 3), (std::vector<float>{1.5f, -2.0f, 0.0f}));
  EXPECT_EQ(*reader->Ints("steps", 2), (std::vector<int64_t>{40, 40}));
  EXPECT_EQ(reader->Floats("x", 4).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(reader->Floats("y", 3).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(reader->Ints("x", 3).status().code(), absl::StatusCode::kDataLoss);
}

// checkpoint.dir is made with its parents when a daemon starts (a job
// whose folder was missing ran on with every checkpoint failing); a file
// in the way is FAILED_PRECONDITION naming the folder.
TEST_F(CheckpointFileTest, TheFolderIsMadeOrTheReasonGiven) {
  const std::string nested = dir_ + "/run/7/checkpoints";
  ASSERT_TRUE(MakeCheckpointDir(nested).ok());
  ASSERT_TRUE(MakeCheckpointDir(nested).ok());  // there already
  CheckpointWriter writer({"shard", 0, 1, 2, 3});
  EXPECT_TRUE(writer.Write(nested + "/shard-0.ckpt").ok());
  std::ofstream(dir_ + "/file") << "x";
  for (const std::string& blocked : {dir_ + "/file", dir_ + "/file/below"}) {
    const absl::Status made = MakeCheckpointDir(blocked);
    EXPECT_EQ(made.code(), absl::StatusCode::kFailedPrecondition) << made;
    EXPECT_NE(made.message().find(blocked), std::string::npos) << made;
  }
}

TEST_F(CheckpointFileTest, MissingTruncatedAndModifiedFiles) {
  EXPECT_EQ(CheckpointReader::Open(path_).status().code(),
            absl::StatusCode::kNotFound);
  CheckpointWriter writer({"worker", 0, 1, 2, 3});
  writer.AddFloats("e", std::vector<float>(100, 0.25f));
  ASSERT_TRUE(writer.Write(path_).ok());
  const std::string good = Bytes();
  for (size_t cut : {size_t{0}, size_t{5}, good.size() / 2, good.size() - 1}) {
    Overwrite(good.substr(0, cut));
    EXPECT_EQ(CheckpointReader::Open(path_).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  for (size_t at : {size_t{9}, size_t{30}, good.size() / 2, good.size() - 3}) {
    std::string bad = good;
    bad[at] ^= 1;
    Overwrite(bad);
    const auto status = CheckpointReader::Open(path_).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << at;
    EXPECT_NE(status.message().find(path_), absl::string_view::npos);
  }
  // No temporary file is left behind by a successful write.
  Overwrite(good);
  EXPECT_TRUE(CheckpointReader::Open(path_).ok());
  std::ifstream temp(path_ + ".tmp");
  EXPECT_FALSE(temp.good());
}

}  // namespace
}  // namespace morse::proto
