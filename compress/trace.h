// A step timeline in Chrome's trace-event JSON (opens in Perfetto and
// chrome://tracing): one file per process, written when tracing stops (or
// the process exits). Workers and shards mark where a step's time goes:
// per partition, its encode, the wait for its reply, its apply; per shard,
// each push received, the sum and recompression, the replies, the mirror.
//
//   trace::Start("/tmp/rank-0.json", "rank 0");   // MORSE_TRACE, --trace
//   { trace::Scope s("encode", step, partition); ... }
//
// Off by default, and then each mark costs one atomic load. Events
// are kept in memory (at most kMaxEvents; later ones are counted, not kept)
// and written once. Thread-safe.
#ifndef MORSE_COMPRESS_TRACE_H_
#define MORSE_COMPRESS_TRACE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace morse::trace {

inline constexpr size_t kMaxEvents = 4'000'000;

namespace internal {
extern std::atomic<bool> enabled;
}  // namespace internal

inline bool Enabled() {
  return internal::enabled.load(std::memory_order_acquire);
}

// Starts recording for this process, named `process` in the file (a rank,
// a shard); the file at `path` is written by Stop, which also runs at
// exit. FAILED_PRECONDITION if already started; the path is checked by
// creating the file now.
absl::Status Start(const std::string& path, const std::string& process);
// Writes the file and stops recording (nothing if not started).
absl::Status Stop();

// Microseconds on the trace's clock (steady, since the process started
// tracing).
int64_t NowMicros();

// A span `name` (a string literal) from `start_us` to now on this thread;
// step and partition go into its args (-1: none).
void Complete(const char* name, int64_t start_us, int64_t step = -1,
              int64_t partition = -1);
// A point in time.
void Instant(const char* name, int64_t step = -1, int64_t partition = -1);

// Complete() for the scope's lifetime, when tracing was on at its start
// (and `name` is not null).
class Scope {
 public:
  Scope(const char* name, int64_t step = -1, int64_t partition = -1)
      : name_(name),
        step_(step),
        partition_(partition),
        start_(name != nullptr && Enabled() ? NowMicros() : -1) {}
  ~Scope() {
    if (start_ >= 0) Complete(name_, start_, step_, partition_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  int64_t step_, partition_, start_;
};

// "{rank}" in `pattern` replaced by `value` (MORSE_TRACE's files).
std::string ExpandPath(const std::string& pattern, const std::string& value);

}  // namespace morse::trace

#endif  // MORSE_COMPRESS_TRACE_H_
