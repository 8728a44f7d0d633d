// CheckpointThread: writes shard checkpoints on a thread of its own, so that
// the fsyncs of a periodic checkpoint never run on the gRPC thread that
// completed the step (the snapshot, a memory copy, is taken there; see
// ShardCore::Snapshot). At most one snapshot waits: a newer one replaces it,
// since only the latest checkpoint matters. Thread-safe.
#ifndef MORSE_SERVER_CHECKPOINT_THREAD_H_
#define MORSE_SERVER_CHECKPOINT_THREAD_H_

#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "compress/sync.h"
#include "proto/checkpoint_file.h"

namespace morse::server {

class CheckpointThread {
 public:
  // `done` is called on the writing thread after each write, with its
  // result, the step written and the reason given to Submit.
  using Done = std::function<void(const absl::Status& status, int64_t step,
                                  const std::string& why)>;
  CheckpointThread(std::string path, Done done);
  // Writes what is pending, then stops.
  ~CheckpointThread();
  CheckpointThread(const CheckpointThread&) = delete;
  CheckpointThread& operator=(const CheckpointThread&) = delete;

  void Submit(proto::CheckpointWriter snapshot, std::string why);
  // Returns once nothing is pending or being written.
  void Flush();

 private:
  void Run();

  const std::string path_;
  const Done done_;
  Mutex mu_;
  std::optional<std::pair<proto::CheckpointWriter, std::string>> pending_
      ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace morse::server

#endif  // MORSE_SERVER_CHECKPOINT_THREAD_H_
