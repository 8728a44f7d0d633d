// Checkpoint files: a header that says whose state it is and which job, then
// named arrays, then a checksum of everything before it. Written atomically
// (a temporary file in the same directory, fsync, rename, fsync of the
// directory), so a crash leaves the old checkpoint or the new one, never half
// of one. Readers verify the magic, version, checksum and every size before
// handing anything out, and say what is wrong with a file that fails.
//
//   "MORSECKP" u32 version
//   u32 len, kind ("shard" or "worker")   u32 index   u64 layout fingerprint
//   u64 algorithm fingerprint             i64 step    u32 arrays
//   per array: u32 len, name; u8 type (0 fp32, 1 i64, 2 bytes); u64 count; data
//   u64 checksum (FNV-1a over 8-byte words of all the bytes before it)
// All little-endian.
#ifndef MORSE_PROTO_CHECKPOINT_FILE_H_
#define MORSE_PROTO_CHECKPOINT_FILE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace morse::proto {

struct CheckpointHeader {
  std::string kind;  // "shard" or "worker"
  uint32_t index = 0;
  uint64_t layout_fingerprint = 0;
  uint64_t algorithm_fingerprint = 0;
  int64_t step = 0;  // steps completed
};

// Makes `dir` (checkpoint.dir, --checkpoint_dir) and its missing parents,
// so that a daemon's first checkpoint is not its first sign of a folder
// that is not there. FAILED_PRECONDITION naming the folder and why when it
// cannot (a file in the way, no permission).
absl::Status MakeCheckpointDir(const std::string& dir);

class CheckpointWriter {
 public:
  explicit CheckpointWriter(CheckpointHeader header)
      : header_(std::move(header)) {}
  void AddFloats(const std::string& name, absl::Span<const float> values);
  void AddInts(const std::string& name, absl::Span<const int64_t> values);
  void AddBytes(const std::string& name, absl::string_view bytes);
  // Writes `path` atomically; the directory must exist.
  absl::Status Write(const std::string& path) const;
  const CheckpointHeader& header() const { return header_; }

 private:
  CheckpointHeader header_;
  std::string body_;
  uint32_t arrays_ = 0;
};

class CheckpointReader {
 public:
  // NOT_FOUND if there is no file; DATA_LOSS if it is corrupt or truncated.
  static absl::StatusOr<CheckpointReader> Open(const std::string& path);

  const CheckpointHeader& header() const { return header_; }
  // The array, which must have `count` elements (DATA_LOSS otherwise).
  absl::StatusOr<std::vector<float>> Floats(const std::string& name,
                                            uint64_t count) const;
  absl::StatusOr<std::vector<int64_t>> Ints(const std::string& name,
                                            uint64_t count) const;
  // A byte array of any length; NOT_FOUND if the file has none of that name
  // (files from before it existed), DATA_LOSS if it is of another type.
  absl::StatusOr<std::string> Bytes(const std::string& name) const;
  // Whether the file has an array of that name (of any type and size).
  bool Has(const std::string& name) const { return arrays_.count(name) != 0; }
  // Its element count (0 if there is none).
  uint64_t Count(const std::string& name) const {
    auto it = arrays_.find(name);
    return it == arrays_.end() ? 0 : it->second.count;
  }
  const std::string& path() const { return path_; }

 private:
  template <class T>
  absl::StatusOr<std::vector<T>> Read(const std::string& name, uint64_t count,
                                      uint8_t type,
                                      const char* type_name) const;

  struct Array {
    uint8_t type;
    uint64_t count;
    size_t offset;
  };
  std::string path_;
  std::string bytes_;
  CheckpointHeader header_;
  std::map<std::string, Array> arrays_;
};

}  // namespace morse::proto

#endif  // MORSE_PROTO_CHECKPOINT_FILE_H_
