#include "worker/timer.h"

namespace morse::worker {

Timer::Timer() : thread_([this] { Run(); }) {}

Timer::~Timer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void Timer::At(absl::Time when, std::function<void()> fn) {
  MutexLock lock(&mu_);
  tasks_.emplace(std::make_pair(when, next_id_++), std::move(fn));
}

void Timer::Run() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    if (tasks_.empty()) {
      mu_.Await(absl::Condition(
          +[](Timer* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return t->stopping_ || !t->tasks_.empty();
          },
          this));
      continue;
    }
    const absl::Time due = tasks_.begin()->first.first;
    if (absl::Now() < due) {
      // Wakes for an earlier task scheduled meanwhile, or at `due`.
      const auto first = tasks_.begin()->first;
      struct Wake {
        Timer* timer;
        std::pair<absl::Time, uint64_t> first;
      } wake{this, first};
      mu_.AwaitWithDeadline(
          absl::Condition(
              +[](Wake* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return w->timer->stopping_ || w->timer->tasks_.empty() ||
                       w->timer->tasks_.begin()->first < w->first;
              },
              &wake),
          due);
      continue;
    }
    std::function<void()> fn = std::move(tasks_.begin()->second);
    tasks_.erase(tasks_.begin());
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
}

}  // namespace morse::worker
