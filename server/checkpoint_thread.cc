#include "server/checkpoint_thread.h"

#include <utility>

namespace morse::server {

CheckpointThread::CheckpointThread(std::string path, Done done)
    : path_(std::move(path)),
      done_(std::move(done)),
      thread_([this] { Run(); }) {}

CheckpointThread::~CheckpointThread() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void CheckpointThread::Submit(proto::CheckpointWriter snapshot,
                              std::string why) {
  MutexLock lock(&mu_);
  pending_.emplace(std::move(snapshot), std::move(why));
}

void CheckpointThread::Flush() {
  MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CheckpointThread* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !t->pending_.has_value() && !t->writing_;
      },
      this));
}

void CheckpointThread::Run() {
  while (true) {
    std::optional<std::pair<proto::CheckpointWriter, std::string>> job;
    {
      MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointThread* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return t->pending_.has_value() || t->stopping_;
          },
          this));
      if (!pending_.has_value()) return;  // stopping, nothing left
      job.emplace(*std::move(pending_));
      pending_.reset();
      writing_ = true;
    }
    const absl::Status status = job->first.Write(path_);
    if (done_) done_(status, job->first.header().step, job->second);
    MutexLock lock(&mu_);
    writing_ = false;
  }
}

}  // namespace morse::server
