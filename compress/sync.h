// Morse's lock, lock guard and one-shot notification: Abseil's, except in a
// ThreadSanitizer build.
//
// Debian's Abseil is a prebuilt library without TSan's instrumentation, so
// TSan does not see absl::Mutex lock or unlock: every access guarded by
// one would be reported as a race, and real races would drown among them.
// With MORSE_STD_SYNC (set by CMake when MORSE_SANITIZE names `thread`)
// the same interface is built on std::mutex and std::condition_variable,
// whose pthread calls TSan intercepts. Everything else is the same: the
// thread-safety annotations, absl::Condition for Await, and behaviour
// (Await re-evaluates its condition whenever the lock is released).
//
// Code says morse::Mutex, MutexLock and Notification, never absl's.
#ifndef MORSE_COMPRESS_SYNC_H_
#define MORSE_COMPRESS_SYNC_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#ifdef MORSE_STD_SYNC
#include <chrono>
#include <condition_variable>
#include <mutex>
#endif

namespace morse {

#ifndef MORSE_STD_SYNC

using Mutex = absl::Mutex;
using MutexLock = absl::MutexLock;
using Notification = absl::Notification;

#else

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    // Whoever Awaits re-evaluates its condition: the state may have changed.
    changed_.notify_all();
    mu_.unlock();
  }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

  // Releases the lock until `condition` holds (evaluated under the lock).
  void Await(const absl::Condition& condition)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    AwaitWithDeadline(condition, absl::InfiniteFuture());
  }
  // Likewise, giving up at the deadline; true if the condition holds.
  bool AwaitWithDeadline(const absl::Condition& condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    changed_.notify_all();  // this thread may have changed the state first
    while (!condition.Eval()) {
      if (deadline == absl::InfiniteFuture()) {
        changed_.wait(lock);
      } else if (changed_.wait_until(lock, absl::ToChronoTime(deadline)) ==
                 std::cv_status::timeout) {
        const bool holds = condition.Eval();
        lock.release();
        return holds;
      }
    }
    lock.release();  // the caller still holds mu_
    return true;
  }
  bool AwaitWithTimeout(const absl::Condition& condition,
                        absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    return AwaitWithDeadline(condition, absl::Now() + timeout);
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }

 private:
  Mutex* const mu_;
};

class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
  }
  bool HasBeenNotified() const {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() const {
    MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&notified_));
  }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&notified_), timeout);
  }

 private:
  mutable Mutex mu_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

#endif  // MORSE_STD_SYNC

}  // namespace morse

#endif  // MORSE_COMPRESS_SYNC_H_
