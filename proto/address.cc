#include "proto/address.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace morse::proto {

absl::StatusOr<HostPort> SplitHostPort(absl::string_view address,
                                       absl::string_view what) {
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", address, "' is not HOST:PORT (", why, ")"));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return refuse("no port");
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  if (host.empty() || host == "[]") return refuse("no host");
  if (port.empty() || port.size() > 5) {
    return refuse("the port is a number in 0..65535");
  }
  uint32_t value = 0;
  for (const char c : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return refuse("the port is a number in 0..65535");
    }
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value > 65535) return refuse("the port is a number in 0..65535");
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

}  // namespace morse::proto
