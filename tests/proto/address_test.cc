#include "proto/address.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace morse::proto {
namespace {

TEST(AddressTest, HostPortSplits) {
  const struct {
    const char* address;
    const char* host;
    uint16_t port;
  } cases[] = {{"127.0.0.1:7000", "127.0.0.1", 7000},
               {"0.0.0.0:0", "0.0.0.0", 0},
               {"node-a:65535", "node-a", 65535},
               {"[::1]:29400", "::1", 29400}};
  for (const auto& c : cases) {
    const auto split = SplitHostPort(c.address, "--listen");
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(split->host, c.host);
    EXPECT_EQ(split->port, c.port);
  }
}

// gRPC took "127.0.0.1:99999" as port 34463 (99999 modulo 65536), and a
// worker given "a" as a shard's address waited for it forever.
TEST(AddressTest, WhatIsNotHostPortIsRefusedNamingTheFlag) {
  for (const char* address : {"127.0.0.1:99999", "127.0.0.1:100000", "nonsense",
                              "127.0.0.1:", ":7000", "[]:7000",
                              "127.0.0.1:70a0", "127.0.0.1:-1", "a"}) {
    const auto port = SplitHostPort(address, "--listen");
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
