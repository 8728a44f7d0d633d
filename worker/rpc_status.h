// What the push client and its step exchange say about calls: time since
// a start, which failures are worth retrying, and a failed call's status
// with what was being done. Internal to worker/.
#ifndef MORSE_WORKER_RPC_STATUS_H_
#define MORSE_WORKER_RPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace morse::worker {

inline double Since(absl::Time start) {
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// Transient failures worth retrying: the server is not reachable yet, or
// not initialized yet.
inline bool Retryable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable;
}

// A failed call's status: its canonical code, with what was being done.
inline absl::Status RpcError(const absl::Status& status,
                             absl::string_view what) {
  return absl::Status(status.code(),
                      absl::StrCat(what, ": ", status.message()));
}

}  // namespace morse::worker

#endif  // MORSE_WORKER_RPC_STATUS_H_
