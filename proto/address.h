// HOST:PORT as the daemons and morse.torch take them on flags and in
// server lists: checked before gRPC or Asio sees them, which would take
// "127.0.0.1:99999" as port 34463 (the number modulo 65536) or wait forever
// on a name without a port.
#ifndef MORSE_PROTO_ADDRESS_H_
#define MORSE_PROTO_ADDRESS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace morse::proto {

struct HostPort {
  std::string host;  // a name or a literal; an IPv6 one without its brackets
  uint16_t port = 0;
};

// `address` (HOST:PORT, or [IPv6]:PORT) split, or INVALID_ARGUMENT naming
// `what` (the flag, say) where HOST is empty or PORT is not a number in
// 0..65535. HOST itself is left to the resolver.
absl::StatusOr<HostPort> SplitHostPort(absl::string_view address,
                                       absl::string_view what);

}  // namespace morse::proto

#endif  // MORSE_PROTO_ADDRESS_H_
