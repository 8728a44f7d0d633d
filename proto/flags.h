// ParseFlags: Abseil flag parsing for Morse's binaries, with --help listing
// the flags defined in the binary's own main file (Abseil would otherwise
// match flags by the program's name, which our file names do not contain).
// Header-only, so tools that do not link morse_proto can use it.
#ifndef MORSE_PROTO_FLAGS_H_
#define MORSE_PROTO_FLAGS_H_

#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace morse::proto {

// `main_file` is how the defining file's path ends, e.g. "/main.cc".
inline void ParseFlags(int argc, char** argv, const char* usage,
                       const char* main_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const std::string suffix = main_file;
  config.contains_help_flags = [suffix](absl::string_view file) {
    return absl::EndsWith(file, suffix);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  absl::ParseCommandLine(argc, argv);
}

}  // namespace morse::proto

#endif  // MORSE_PROTO_FLAGS_H_
