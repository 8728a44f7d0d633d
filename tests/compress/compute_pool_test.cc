#include "compress/compute_pool.h"

#include <atomic>
#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "compress/sync.h"
#include "gtest/gtest.h"

namespace morse::compress {
namespace {

TEST(ComputePoolTest, RunsEveryTaskBeforeItIsDestroyed) {
  std::atomic<int> ran{0};
  {
    ComputePool pool(3);
    EXPECT_EQ(pool.threads(), 3);
    for (int i = 0; i < 1000; ++i) pool.Schedule([&ran] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 1000);
}

TEST(ComputePoolTest, RunsTasksOnAsManyThreadsAsItHas) {
  constexpr int kThreads = 4;
  // Every task waits until all kThreads have started one: this completes
  // only if the pool runs kThreads tasks at once. The pool is declared last
  // so that it is gone (its tasks finished) before what they lock.
  Mutex mu;
  int started = 0;
  std::set<std::thread::id> ids;
  ComputePool pool(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    pool.Schedule([&] {
      MutexLock lock(&mu);
      ++started;
      ids.insert(std::this_thread::get_id());
      mu.Await(absl::Condition(
          +[](int* n) { return *n == kThreads; }, &started));
    });
  }
  MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](int* n) { return *n == kThreads; }, &started));
  EXPECT_EQ(ids.size(), static_cast<size_t>(kThreads));
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
}

TEST(ComputePoolTest, ATaskMaySchedule) {
  std::atomic<int> ran{0};
  Notification done;
  {
    ComputePool pool(1);
    pool.Schedule([&] {
      ran.fetch_add(1);
      pool.Schedule([&] {
        ran.fetch_add(1);
        done.Notify();
      });
    });
    done.WaitForNotification();
  }
  EXPECT_EQ(ran.load(), 2);
}

TEST(ComputePoolTest, ParallelForRunsEveryIndexOnceEvenWhileThePoolIsBusy) {
  // Before the pool, so that the pool's threads are joined before the lock
  // its blocked tasks hold goes away.
  Mutex mu;
  bool release = false;
  ComputePool pool(3);
  for (size_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> calls(n);
    pool.ParallelFor(n, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(calls[i].load(), 1) << "n=" << n << " i=" << i;
  }
  // Every pool thread blocked for a while: the caller takes the indices
  // itself, and ParallelFor returns once the helpers it scheduled have run.
  for (int t = 0; t < pool.threads(); ++t) {
    pool.Schedule([&] {
      MutexLock lock(&mu);
      mu.Await(absl::Condition(&release));
    });
  }
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    MutexLock lock(&mu);
    release = true;
  });
  std::vector<std::atomic<int>> calls(64);
  pool.ParallelFor(calls.size(), [&](size_t i) { calls[i].fetch_add(1); });
  releaser.join();
  for (size_t i = 0; i < calls.size(); ++i) ASSERT_EQ(calls[i].load(), 1) << i;
}

TEST(ComputePoolTest, DefaultsToAtLeastOneThread) {
  EXPECT_GE(ComputePool::DefaultThreads(), 1);
}

TEST(ComputePoolTest, TheFlagIsOneToATousandTwentyFourOrZeroForTheDefault) {
  EXPECT_EQ(*ComputePool::ThreadsFromFlag(0), ComputePool::DefaultThreads());
  EXPECT_EQ(*ComputePool::ThreadsFromFlag(8), 8);
  EXPECT_EQ(*ComputePool::ThreadsFromFlag(1024), 1024);
  for (int bad : {-1, 1025}) {
    const absl::StatusOr<int> threads = ComputePool::ThreadsFromFlag(bad);
    ASSERT_FALSE(threads.ok());
    EXPECT_EQ(threads.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(threads.status().message().find("--compute_threads"),
              std::string::npos);
  }
}

// A background task starts only when no foreground task waits: with the one
// thread busy, a background task scheduled before two foreground ones runs
// after both; and the destructor runs background tasks too.
TEST(ComputePoolTest, BackgroundTasksWaitBehindForegroundOnes) {
  Mutex mu;
  std::vector<std::string> order;
  Notification release;
  {
    ComputePool pool(1);
    Notification started;
    pool.Schedule([&] {
      started.Notify();
      release.WaitForNotification();
      MutexLock lock(&mu);
      order.push_back("first");
    });
    started.WaitForNotification();  // the thread is busy from here
    pool.ScheduleBackground([&] {
      MutexLock lock(&mu);
      order.push_back("background");
    });
    for (const char* name : {"second", "third"}) {
      pool.Schedule([&, name] {
        MutexLock lock(&mu);
        order.push_back(name);
      });
    }
    release.Notify();
  }
  EXPECT_EQ(order, (std::vector<std::string>{"first", "second", "third",
                                             "background"}));
  std::atomic<int> ran{0};
  {
    ComputePool pool(2);
    for (int i = 0; i < 100; ++i)
      pool.ScheduleBackground([&ran] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 100);
}

// Stop runs what is scheduled, including what those tasks schedule, and
// joins; afterwards a task runs on the caller's thread at once; the
// destructor then has nothing left to do.
TEST(ComputePoolTest, StopRunsEverythingAndThenRunsTasksInline) {
  std::atomic<int> ran{0};
  ComputePool pool(2);
  for (int i = 0; i < 50; ++i) {
    pool.Schedule([&] {
      ran.fetch_add(1);
      pool.ScheduleBackground([&ran] { ran.fetch_add(1); });
    });
  }
  pool.Stop();
  EXPECT_EQ(ran.load(), 100);
  std::thread::id where;
  pool.Schedule([&where] { where = std::this_thread::get_id(); });
  EXPECT_EQ(where, std::this_thread::get_id());
  pool.Stop();  // idempotent
}

}  // namespace
}  // namespace morse::compress
