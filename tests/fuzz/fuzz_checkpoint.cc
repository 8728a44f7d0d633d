// libFuzzer target: the checkpoint reader (proto/checkpoint_file.h) on
// arbitrary files. Open must refuse anything corrupt or truncated with
// DATA_LOSS, and reading any array of an accepted file must stay in bounds.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "proto/checkpoint_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      "/tmp/morse-fuzz-checkpoint-" + std::to_string(getpid());
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  } else {
    return 0;
  }
  auto reader = morse::proto::CheckpointReader::Open(path);
  if (!reader.ok()) return 0;
  for (const char* name :
       {"x", "m", "v", "server_error", "worker_error", "last_reply_meta",
        "push_hashes", "last_hashes", "last_replies"}) {
    for (uint64_t count :
         {uint64_t{0}, uint64_t{1}, uint64_t{16}, uint64_t{1} << 40}) {
      (void)reader->Floats(name, count);
      (void)reader->Ints(name, count);
    }
    (void)reader->Bytes(name);
  }
  return 0;
}
