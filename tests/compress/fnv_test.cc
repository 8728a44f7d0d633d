#include "compress/fnv.h"

#include <string>
#include <vector>

#include "compress/bytes_hash.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

// Published FNV-1a 64 answers: "" and "a" (bytes mixed one at a time).
TEST(FnvTest, KnownAnswers) {
  EXPECT_EQ(Fnv64().value(), 0xcbf29ce484222325ull);
  Fnv64 a;
  a.MixWords("a", 1);
  EXPECT_EQ(a.value(), 0xaf63dc4c8601ec8cull);
  Fnv64 foobar;
  foobar.MixWords("foobar", 6);  // shorter than a word: byte by byte
  EXPECT_EQ(foobar.value(), 0x85944171f73967e8ull);
}

TEST(FnvTest, IntegersAreMixedLittleEndianByteByByte) {
  Fnv64 by_int, by_bytes;
  by_int.MixInt(0x0807060504030201ull);
  for (char c = 1; c <= 8; ++c) by_bytes.MixWords(&c, 1);
  EXPECT_EQ(by_int.value(), by_bytes.value());
}

// BytesHash's values are pinned (shard checkpoints keep them): bytes
// 1, 8, 15, ... (i * 7 + 1), whole lanes and a tail.
TEST(BytesHashTest, KnownAnswers) {
  std::string bytes;
  for (int i = 0; i < 100; ++i) bytes.push_back(static_cast<char>(i * 7 + 1));
  EXPECT_EQ(BytesHash("", 0), 0x16a85032825f04e7ull);
  EXPECT_EQ(BytesHash(bytes.data(), 32), 0xd3695a9d5fc0ce95ull);
  EXPECT_EQ(BytesHash(bytes), 0xa2c198adc4177dd0ull);
}

// Any one bit flipped anywhere (every lane, the tail), a byte moved between
// lanes or a zero byte appended gives another hash.
TEST(BytesHashTest, EveryBitAndTheLengthCount) {
  std::vector<uint8_t> bytes(203);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  const uint64_t base = BytesHash(bytes.data(), bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<uint8_t>(1 << bit);
      ASSERT_NE(BytesHash(bytes.data(), bytes.size()), base) << i << " " << bit;
      bytes[i] ^= static_cast<uint8_t>(1 << bit);
    }
  }
  std::swap(bytes[0], bytes[8]);  // word 0 of lane 0 and word 0 of lane 1
  EXPECT_NE(BytesHash(bytes.data(), bytes.size()), base);
  std::swap(bytes[0], bytes[8]);
  bytes.push_back(0);
  EXPECT_NE(BytesHash(bytes.data(), bytes.size()), base);
}

}  // namespace
}  // namespace morse::compress
