#include "compress/fnv.h"

#include <string>

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

}  // namespace
}  // namespace morse::compress
