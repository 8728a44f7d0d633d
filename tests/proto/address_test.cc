#include "proto/address.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace morse::proto {
namespace {

TEST(AddressTest, HostPortGivesItsPort) {
  EXPECT_EQ(*PortOf("127.0.0.1:7000", "--listen"), 7000);
  EXPECT_EQ(*PortOf("0.0.0.0:0", "--listen"), 0);
  EXPECT_EQ(*PortOf("node-a:65535", "--listen"), 65535);
  EXPECT_EQ(*PortOf("[::1]:29400", "--listen"), 29400);
}

// gRPC took "127.0.0.1:99999" as port 34463 (99999 modulo 65536), and a
// worker given "a" as a shard's address waited for it forever.
TEST(AddressTest, WhatIsNotHostPortIsRefusedNamingTheFlag) {
  for (const char* address : {"127.0.0.1:99999", "127.0.0.1:100000", "nonsense",
                              "127.0.0.1:", ":7000", "[]:7000",
                              "127.0.0.1:70a0", "127.0.0.1:-1", "a"}) {
    const auto port = PortOf(address, "--listen");
    ASSERT_FALSE(port.ok()) << address;
    EXPECT_EQ(port.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(port.status().message(),
                                  absl::StrCat("--listen '", address, "'")))
        << port.status();
    EXPECT_TRUE(absl::StrContains(port.status().message(), "HOST:PORT"))
        << port.status();
  }
}

}  // namespace
}  // namespace morse::proto
