// ParseFlags: Abseil flag parsing for Morse's binaries, with --help listing
// the flags defined in the binary's own main file and the shared credential
// flags (Abseil would otherwise match flags by the program's name, which our
// file names do not contain). Flag names may be spelled with dashes or
// underscores (--check-config is --check_config).
// Header-only, so tools that do not link morse_proto can use it.
#ifndef MORSE_PROTO_FLAGS_H_
#define MORSE_PROTO_FLAGS_H_

#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace morse::proto {

// "--tls-cert=x" -> "--tls_cert=x"; values and positional arguments are kept.
inline std::string UnderscoreFlagName(const std::string& arg) {
  if (arg.size() < 3 || arg[0] != '-' || arg == "--") return arg;
  const size_t start = arg[1] == '-' ? 2 : 1;
  const size_t end = std::min(arg.find('='), arg.size());
  std::string out = arg;
  for (size_t i = start; i < end; ++i) {
    if (out[i] == '-') out[i] = '_';
  }
  return out;
}

// `main_file` is how the defining file's path ends, e.g. "/main.cc".
inline void ParseFlags(int argc, char** argv, const char* usage,
                       const char* main_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const std::string suffix = main_file;
  config.contains_help_flags = [suffix](absl::string_view file) {
    return absl::EndsWith(file, suffix) ||
           absl::EndsWith(file, "proto/security_flags.cc");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  // --help's headings name the flags' files from the source tree, not
  // from wherever the binary was built.
  config.normalize_filename = [](absl::string_view file) -> std::string {
    for (absl::string_view top : {"proto/", "server/", "worker/"}) {
      const size_t at = file.rfind(top);
      if (at != absl::string_view::npos) return std::string(file.substr(at));
    }
    return std::string(file);
  };
  absl::SetFlagsUsageConfig(config);
  // Normalized copies of the flags up to "--" (after it, arguments are data).
  static std::vector<std::string> storage;
  std::vector<char*> args;
  bool flags_done = false;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") flags_done = true;
    storage.push_back(i == 0 || flags_done ? arg : UnderscoreFlagName(arg));
  }
  for (std::string& s : storage) args.push_back(s.data());
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
}

}  // namespace morse::proto

#endif  // MORSE_PROTO_FLAGS_H_
