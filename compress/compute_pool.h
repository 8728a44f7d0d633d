// ComputePool: a fixed set of threads that run the data path's per-partition
// work (a shard's aggregation and recompression, a worker's encoding and the
// application of its replies) so that it uses the host's cores instead of
// gRPC's callback threads or the caller's (docs/design.md 7).
//
// Tasks start in the order they were scheduled (background tasks after
// every waiting foreground one), on whichever thread is free;
// callers that need an order between two tasks must enforce it themselves
// (the data path's tasks touch disjoint partitions, so results do not depend
// on the thread count). The destructor runs every task already scheduled,
// then joins the threads; a task scheduled while it does runs on the
// caller's thread.
//
// Thread-safe.
#ifndef MORSE_COMPRESS_COMPUTE_POOL_H_
#define MORSE_COMPRESS_COMPUTE_POOL_H_

#include <deque>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "compress/sync.h"

namespace morse::compress {

class ComputePool {
 public:
  // The default size: the cores this process may run on (at least 1).
  static int DefaultThreads();
  // The size a daemon's --compute_threads asks for: 1..1024 as given, 0 for
  // DefaultThreads(); INVALID_ARGUMENT naming the flag otherwise.
  static absl::StatusOr<int> ThreadsFromFlag(int flag);

  // `threads` >= 1.
  explicit ComputePool(int threads);
  ~ComputePool();  // Stop()
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  void Schedule(absl::AnyInvocable<void() &&> task);
  // A task that may wait: it starts only when no task of Schedule's is
  // waiting (a shard's mirror update, which whatever reads the mirror
  // brings up to date itself, behind the replies workers wait for). Run by
  // the destructor like the others.
  void ScheduleBackground(absl::AnyInvocable<void() &&> task);
  // Runs every task already scheduled and joins the threads; from then on a
  // task scheduled runs on the caller's thread. For an owner whose tasks
  // still reach the pool through it while it stops (the destructor calls
  // it too). Not from a task of this pool; idempotent.
  void Stop();
  // Runs fn(i) for every i in [0, n), on the pool's threads and the
  // caller's, and returns once every call has returned. The caller takes
  // indices too, so the loop finishes even when the pool is busy with other
  // tasks. Not from a task of this pool.
  void ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run();

  Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::AnyInvocable<void() &&>> background_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_COMPUTE_POOL_H_
