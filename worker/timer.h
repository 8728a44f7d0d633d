// Timer: runs callbacks at given times on a thread of its own, so that
// waiting (a retry's backoff, a deadline) never blocks the thread that
// asked for it — gRPC's callback threads in particular (STYLE: no sleeps on
// a reactor). Callbacks run one at a time, in time order, outside the
// timer's lock; they may schedule more.
//
// The destructor drops what has not run yet and joins the thread: destroy
// a timer only when nothing scheduled still matters. Thread-safe.
#ifndef MORSE_WORKER_TIMER_H_
#define MORSE_WORKER_TIMER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/time/time.h"
#include "compress/sync.h"

namespace morse::worker {

class Timer {
 public:
  Timer();
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Runs `fn` on the timer's thread at `when` (at once if that has passed).
  void At(absl::Time when, std::function<void()> fn);
  void After(absl::Duration delay, std::function<void()> fn) {
    At(absl::Now() + delay, std::move(fn));
  }

 private:
  void Run();

  Mutex mu_;
  // By time, then by the order scheduled.
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> tasks_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_TIMER_H_
