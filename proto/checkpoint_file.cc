#include "proto/checkpoint_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compress/fnv.h"
#include "compress/replica.h"

namespace morse::proto {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'R', 'S', 'E', 'C', 'K', 'P'};
constexpr uint32_t kVersion = 1;

template <class T>
void Put(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof value);
}

void PutString(std::string* out, const std::string& s) {
  Put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

uint64_t Checksum(absl::string_view bytes) {
  compress::Fnv64 hash;
  hash.MixWords(bytes.data(), bytes.size());
  return hash.value();
}

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Reads fixed-size values off a byte string, failing past its end.
class Cursor {
 public:
  explicit Cursor(absl::string_view bytes) : bytes_(bytes) {}
  template <class T>
  bool Get(T* value) {
    if (bytes_.size() - at_ < sizeof(T)) return false;
    std::memcpy(value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t len;
    if (!Get(&len) || bytes_.size() - at_ < len) return false;
    s->assign(bytes_.data() + at_, len);
    at_ += len;
    return true;
  }
  bool Skip(uint64_t n) {
    if (bytes_.size() - at_ < n) return false;
    at_ += n;
    return true;
  }
  size_t at() const { return at_; }

 private:
  absl::string_view bytes_;
  size_t at_ = 0;
};

}  // namespace

void CheckpointWriter::AddFloats(const std::string& name,
                                 absl::Span<const float> values) {
  PutString(&body_, name);
  Put<uint8_t>(&body_, 0);
  Put<uint64_t>(&body_, values.size());
  body_.append(reinterpret_cast<const char*>(values.data()), 4 * values.size());
  ++arrays_;
}

void CheckpointWriter::AddInts(const std::string& name,
                               absl::Span<const int64_t> values) {
  PutString(&body_, name);
  Put<uint8_t>(&body_, 1);
  Put<uint64_t>(&body_, values.size());
  body_.append(reinterpret_cast<const char*>(values.data()), 8 * values.size());
  ++arrays_;
}

void CheckpointWriter::AddBytes(const std::string& name,
                                absl::string_view bytes) {
  PutString(&body_, name);
  Put<uint8_t>(&body_, 2);
  Put<uint64_t>(&body_, bytes.size());
  body_.append(bytes.data(), bytes.size());
  ++arrays_;
}

absl::Status MakeCheckpointDir(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (!error && std::filesystem::is_directory(dir, error)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint folder ", dir, " cannot be made: ",
      error ? error.message() : "something else is there by that name"));
}

absl::Status CheckpointWriter::Write(const std::string& path) const {
  std::string bytes(kMagic, sizeof kMagic);
  Put<uint32_t>(&bytes, kVersion);
  PutString(&bytes, header_.kind);
  Put<uint32_t>(&bytes, header_.index);
  Put<uint64_t>(&bytes, header_.layout_fingerprint);
  Put<uint64_t>(&bytes, header_.algorithm_fingerprint);
  Put<int64_t>(&bytes, header_.step);
  Put<uint32_t>(&bytes, arrays_);
  bytes += body_;
  Put<uint64_t>(&bytes, Checksum(bytes));

  const std::string temp = path + ".tmp";
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Errno("cannot create", temp);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      close(fd);
      return Errno("cannot write", temp);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    close(fd);
    return Errno("cannot fsync", temp);
  }
  close(fd);
  if (rename(temp.c_str(), path.c_str()) != 0)
    return Errno("cannot rename to", path);
  const std::string dir = path.find('/') == std::string::npos
                              ? "."
                              : path.substr(0, path.rfind('/'));
  const int dir_fd =
      open(dir.empty() ? "/" : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointReader> CheckpointReader::Open(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  CheckpointReader reader;
  reader.path_ = path;
  reader.bytes_ = buffer.str();
  const auto corrupt = [&](absl::string_view why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, " is corrupt: ", why));
  };
  const std::string& bytes = reader.bytes_;
  if (bytes.size() < sizeof kMagic + 8 ||
      std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    return corrupt("not a Morse checkpoint (bad magic or too short)");
  }
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, 8);
  if (stored !=
      Checksum(absl::string_view(bytes).substr(0, bytes.size() - 8))) {
    return corrupt("checksum mismatch (truncated or modified)");
  }
  Cursor cursor(absl::string_view(bytes).substr(
      sizeof kMagic, bytes.size() - sizeof kMagic - 8));
  uint32_t version, arrays;
  CheckpointHeader& h = reader.header_;
  if (!cursor.Get(&version) || version != kVersion)
    return corrupt("unknown version");
  if (!cursor.GetString(&h.kind) || !cursor.Get(&h.index) ||
      !cursor.Get(&h.layout_fingerprint) ||
      !cursor.Get(&h.algorithm_fingerprint) || !cursor.Get(&h.step) ||
      !cursor.Get(&arrays)) {
    return corrupt("truncated header");
  }
  for (uint32_t a = 0; a < arrays; ++a) {
    std::string name;
    Array array;
    if (!cursor.GetString(&name) || !cursor.Get(&array.type) ||
        !cursor.Get(&array.count) || array.type > 2) {
      return corrupt("bad array header");
    }
    array.offset = sizeof kMagic + cursor.at();
    const uint64_t width = array.type == 0 ? 4 : array.type == 1 ? 8 : 1;
    if (array.count > (UINT64_MAX / width) ||
        !cursor.Skip(array.count * width)) {
      return corrupt(absl::StrCat("array '", name, "' runs past the end"));
    }
    reader.arrays_[name] = array;
  }
  return reader;
}

template <class T>
absl::StatusOr<std::vector<T>> CheckpointReader::Read(
    const std::string& name, uint64_t count, uint8_t type,
    const char* type_name) const {
  auto it = arrays_.find(name);
  if (it == arrays_.end() || it->second.type != type ||
      it->second.count != count) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path_, " has no ",
                                            type_name, " array '", name,
                                            "' of ", count, " elements"));
  }
  std::vector<T> values(count);
  std::memcpy(values.data(), bytes_.data() + it->second.offset,
              sizeof(T) * count);
  return values;
}

absl::StatusOr<std::vector<float>> CheckpointReader::Floats(
    const std::string& name, uint64_t count) const {
  return Read<float>(name, count, 0, "fp32");
}

absl::StatusOr<std::vector<int64_t>> CheckpointReader::Ints(
    const std::string& name, uint64_t count) const {
  return Read<int64_t>(name, count, 1, "int64");
}

absl::StatusOr<std::string> CheckpointReader::Bytes(
    const std::string& name) const {
  auto it = arrays_.find(name);
  if (it == arrays_.end()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", path_, " has no array '", name, "'"));
  }
  if (it->second.type != 2) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path_, ": array '",
                                            name, "' is not a byte array"));
  }
  return bytes_.substr(it->second.offset, it->second.count);
}

}  // namespace morse::proto
