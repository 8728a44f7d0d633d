// libFuzzer target: the job config loader (proto/job_config.h) on arbitrary
// text-format and JSON input. Nothing may crash, hang or allocate without
// bound: absurd sizes are refused by validation, never allocated.
#include <cstdint>
#include <string>

#include "proto/job_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)morse::proto::ParseJobConfig(text, morse::proto::ConfigFormat::kText);
  (void)morse::proto::ParseJobConfig(text, morse::proto::ConfigFormat::kJson);
  (void)morse::proto::ParseJobConfigProto(text);
  // Overrides are merged over a base: arbitrary bytes on either side.
  const size_t half = size / 2;
  (void)morse::proto::ParseJobConfigWithOverrides(text.substr(0, half),
                                                  text.substr(half));
  return 0;
}
