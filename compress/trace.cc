#include "compress/trace.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "compress/sync.h"

namespace morse::trace {
namespace internal {
std::atomic<bool> enabled{false};
}  // namespace internal
namespace {

struct Event {
  const char* name;
  int64_t ts, dur;  // dur < 0: an instant
  int64_t step, partition;
  uint32_t tid;
};

struct State {
  Mutex mu;
  std::string path ABSL_GUARDED_BY(mu);
  std::string process ABSL_GUARDED_BY(mu);
  std::vector<Event> events ABSL_GUARDED_BY(mu);
  uint64_t dropped ABSL_GUARDED_BY(mu) = 0;
  bool at_exit ABSL_GUARDED_BY(mu) = false;
  std::chrono::steady_clock::time_point origin;
};

State& state() {
  static State* s = new State;  // never destroyed: marks may come at exit
  return *s;
}

uint32_t ThreadIndex() {
  static std::atomic<uint32_t> next{1};
  thread_local uint32_t index = next.fetch_add(1, std::memory_order_relaxed);
  return index;
}

void Record(Event e) {
  State& s = state();
  MutexLock lock(&s.mu);
  if (s.events.size() >= kMaxEvents) {
    ++s.dropped;
    return;
  }
  s.events.push_back(e);
}

// JSON string contents (process names are ours, but quote them properly).
std::string Escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

void StopAtExit() {
  if (absl::Status s = Stop(); !s.ok()) {
    std::fprintf(stderr, "morse: the trace was not written: %s\n",
                 std::string(s.message()).c_str());
  }
}

}  // namespace

absl::Status Start(const std::string& path, const std::string& process) {
  State& s = state();
  MutexLock lock(&s.mu);
  if (Enabled()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a trace to ", s.path, " is already being recorded"));
  }
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write the trace file ", path));
  }
  std::fclose(f);
  s.path = path;
  s.process = process;
  s.events.clear();
  s.events.reserve(1 << 16);
  s.dropped = 0;
  s.origin = std::chrono::steady_clock::now();
  if (!s.at_exit) {
    s.at_exit = true;
    std::atexit(StopAtExit);
  }
  internal::enabled.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Stop() {
  State& s = state();
  MutexLock lock(&s.mu);
  if (!Enabled()) return absl::OkStatus();
  internal::enabled.store(false, std::memory_order_relaxed);
  std::FILE* f = std::fopen(s.path.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write ", s.path));
  }
  const long pid = static_cast<long>(getpid());
  std::fprintf(f,
               "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped\":%llu},"
               "\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\","
               "\"pid\":%ld,\"tid\":0,\"args\":{\"name\":\"%s\"}}",
               static_cast<unsigned long long>(s.dropped), pid,
               Escaped(s.process).c_str());
  for (const Event& e : s.events) {
    std::fprintf(f,
                 ",\n{\"name\":\"%s\",\"ph\":\"%s\",\"pid\":%ld,\"tid\":%u,"
                 "\"ts\":%lld",
                 e.name, e.dur < 0 ? "i" : "X", pid, e.tid,
                 static_cast<long long>(e.ts));
    if (e.dur >= 0)
      std::fprintf(f, ",\"dur\":%lld", static_cast<long long>(e.dur));
    else
      std::fprintf(f, ",\"s\":\"t\"");
    std::fprintf(f, ",\"args\":{\"step\":%lld,\"partition\":%lld}}",
                 static_cast<long long>(e.step),
                 static_cast<long long>(e.partition));
  }
  std::fprintf(f, "\n]}\n");
  const bool ok = std::fclose(f) == 0;
  s.events.clear();
  s.events.shrink_to_fit();
  if (!ok) return absl::InternalError(absl::StrCat("cannot write ", s.path));
  return absl::OkStatus();
}

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now() - state().origin)
      .count();
}

void Complete(const char* name, int64_t start_us, int64_t step,
              int64_t partition) {
  if (!Enabled()) return;
  const int64_t now = NowMicros();
  Record({name, start_us, now - start_us, step, partition, ThreadIndex()});
}

void Instant(const char* name, int64_t step, int64_t partition) {
  if (!Enabled()) return;
  Record({name, NowMicros(), -1, step, partition, ThreadIndex()});
}

std::string ExpandPath(const std::string& pattern, const std::string& value) {
  return absl::StrReplaceAll(pattern, {{"{rank}", value}});
}

}  // namespace morse::trace
