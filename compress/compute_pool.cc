#include "compress/compute_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "compress/check.h"

namespace morse::compress {

int ComputePool::DefaultThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

absl::StatusOr<int> ComputePool::ThreadsFromFlag(int flag) {
  if (flag < 0 || flag > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compute_threads ", flag, ": 0 (one per core) to 1024"));
  }
  return flag == 0 ? DefaultThreads() : flag;
}

ComputePool::ComputePool(int threads) {
  MORSE_CHECK(threads >= 1);
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ComputePool::~ComputePool() { Stop(); }

void ComputePool::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void ComputePool::Schedule(absl::AnyInvocable<void() &&> task) {
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      tasks_.push_back(std::move(task));
      return;
    }
  }
  std::move(task)();  // the pool is being destroyed: run it here, never drop it
}

void ComputePool::ScheduleBackground(absl::AnyInvocable<void() &&> task) {
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      background_.push_back(std::move(task));
      return;
    }
  }
  std::move(task)();
}

void ComputePool::ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn) {
  std::atomic<size_t> next{0};
  const auto take = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const size_t helpers = std::min<size_t>(threads_.size(), n > 0 ? n - 1 : 0);
  // morse::Mutex, not absl::BlockingCounter: TSan sees it (compress/sync.h).
  Mutex mu;
  size_t running = helpers;
  for (size_t h = 0; h < helpers; ++h) {
    Schedule([&] {
      take();
      MutexLock lock(&mu);
      --running;
    });
  }
  take();
  MutexLock lock(&mu);  // the helpers hold references to this frame
  mu.Await(absl::Condition(
      +[](size_t* left) { return *left == 0; }, &running));
}

void ComputePool::Run() {
  for (;;) {
    absl::AnyInvocable<void() &&> task;
    {
      MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ComputePool* pool) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return pool->stopping_ || !pool->tasks_.empty() ||
                   !pool->background_.empty();
          },
          this));
      std::deque<absl::AnyInvocable<void()&&>>& queue =
          tasks_.empty() ? background_ : tasks_;
      if (queue.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue.front());
      queue.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace morse::compress
