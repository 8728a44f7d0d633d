// A shard's pool under a burst of partitions: one worker pushes every
// partition of its shard at once (as backward() ends on a GPU host), the
// shard's compute pool averages, recompresses and answers them, and the
// mirror updates wait behind (ComputePool::ScheduleBackground). Prints, per
// step, when the last reply left (what a worker waits for) and when the
// step's work was done (the mirrors, then MirrorChecksum's pass over the
// shard, which applies whatever the pool has not), and their ratio.
//
// Usage: shard_pool_bench [--dim=N] [--partition=N] [--threads=N]
//                         [--steps=N] [--optimizer=adam|onebit_adam]
//                         [--malloc=daemon|default]
// --malloc=daemon (the default) sets malloc up as morse-server does
// (proto::KeepLargeBuffersMapped); default leaves glibc's own settings.
// Prints one JSON line per step after the first, then their medians.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/replica.h"
#include "compress/sync.h"
#include "proto/job_config.h"
#include "proto/process_memory.h"
#include "server/shard_core.h"

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using morse::server::PushArgs;
  using morse::server::ShardCore;
  uint64_t dim = 16 << 20, partition = 1 << 20;
  int threads = 2, steps = 6;
  std::string optimizer = "adam", malloc_mode = "daemon", value;
  for (int i = 1; i < argc; ++i) {
    if (Flag(argv[i], "--dim", &value)) {
      dim = std::strtoull(value.c_str(), nullptr, 10);
    } else if (Flag(argv[i], "--partition", &value)) {
      partition = std::strtoull(value.c_str(), nullptr, 10);
    } else if (Flag(argv[i], "--threads", &value)) {
      threads = std::atoi(value.c_str());
    } else if (Flag(argv[i], "--steps", &value)) {
      steps = std::atoi(value.c_str());
    } else if (Flag(argv[i], "--optimizer", &value)) {
      optimizer = value;
    } else if (Flag(argv[i], "--malloc", &value) &&
               (value == "daemon" || value == "default")) {
      malloc_mode = value;
    } else {
      std::fprintf(stderr,
                   "usage: shard_pool_bench [--dim=N] [--partition=N] "
                   "[--threads=N] [--steps=N] [--optimizer=adam|onebit_adam] "
                   "[--malloc=daemon|default]\n"
                   "  (defaults 16777216, 1048576, 2, 6, adam, daemon)\n");
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 2;
    }
  }
  if (malloc_mode == "daemon") morse::proto::KeepLargeBuffersMapped();
  if (threads < 1 || steps < 2 || partition == 0 || dim < partition) {
    std::fprintf(stderr,
                 "shard_pool_bench: threads >= 1, steps >= 2, "
                 "0 < partition <= dim\n");
    return 2;
  }
  const std::string config = absl::StrCat(
      "workers: 1\nshards: 1\nsynthetic { dim: ", dim, " }\noptimizer: \"",
      optimizer, "\"\nlr { lr: 0.001 }\nsteps: ", steps,
      "\nfreeze_step: 1\npartition_elems: ", partition, "\n");
  auto job =
      morse::proto::ParseJobConfig(config, morse::proto::ConfigFormat::kText);
  if (!job.ok()) {
    std::fprintf(stderr, "%s\n", std::string(job.status().message()).c_str());
    return 2;
  }
  auto core =
      ShardCore::Create(*job, 0, morse::proto::HostMemoryBytes(), threads);
  if (!core.ok()) {
    std::fprintf(stderr, "%s\n", std::string(core.status().message()).c_str());
    return 2;
  }
  const auto& parts = (*core)->layout().shard_partitions(0);
  const uint64_t fingerprint = (*core)->layout().fingerprint();
  for (const auto& p : parts) {
    std::vector<float> x(p.range.size(), 0.5f);
    if (!(*core)
             ->InitPartition(
                 0, p.id, fingerprint,
                 {reinterpret_cast<const char*>(x.data()), 4 * x.size()})
             .ok()) {
      std::fprintf(stderr, "shard_pool_bench: InitPartition failed\n");
      return 1;
    }
  }
  std::vector<double> reply_ms, all_ms;
  for (int step = 0; step < steps; ++step) {
    const morse::compress::CodecSpec codec =
        morse::compress::PlanStep(job->algorithm, step).up;
    // The pushes are encoded before the clock starts.
    std::vector<PushArgs> pushes;
    for (const auto& p : parts) {
      std::vector<float> g(p.range.size());
      for (size_t j = 0; j < g.size(); ++j)
        g[j] =
            1e-3f * static_cast<float>((j * 2654435761u + step) % 2001) - 1.0f;
      PushArgs args;
      args.step = step;
      args.partition = p.id;
      args.layout_fingerprint = fingerprint;
      args.codec = codec.kind;
      args.payload.resize(morse::compress::PayloadBytes(codec, g.size()));
      if (!morse::compress::Encode(
               codec, g, {},
               {reinterpret_cast<uint8_t*>(args.payload.data()),
                args.payload.size()})
               .ok()) {
        std::fprintf(stderr, "shard_pool_bench: encode failed\n");
        return 1;
      }
      pushes.push_back(std::move(args));
    }
    morse::Mutex mu;
    size_t replies = 0;
    bool failed = false;
    Clock::time_point last_reply;
    const Clock::time_point start = Clock::now();
    for (PushArgs& args : pushes) {
      (*core)->Push(std::move(args), [&](auto result) {
        morse::MutexLock lock(&mu);
        failed |= !result.ok();
        last_reply = Clock::now();
        ++replies;
      });
    }
    {
      morse::MutexLock lock(&mu);
      struct Wait {
        size_t* replies;
        size_t want;
      } wait{&replies, parts.size()};
      mu.Await(absl::Condition(
          +[](Wait* w) { return *w->replies == w->want; }, &wait));
    }
    // Whatever is pending of the mirrors, applied here if the pool has not.
    (void)(*core)->MirrorChecksum();
    const Clock::time_point done = Clock::now();
    if (failed) {
      std::fprintf(stderr, "shard_pool_bench: a push failed at step %d\n",
                   step);
      return 1;
    }
    if (step == 0) continue;  // first touches of the arrays
    reply_ms.push_back(Ms(last_reply - start));
    all_ms.push_back(Ms(done - start));
    std::printf(
        "{\"bench\": \"shard_pool\", \"step\": %d, \"optimizer\": \"%s\", "
        "\"codec\": \"%s\", \"partitions\": %zu, \"threads\": %d, "
        "\"last_reply_ms\": %.2f, \"all_done_ms\": %.2f, "
        "\"reply_over_all\": %.3f}\n",
        step, optimizer.c_str(),
        std::string(morse::compress::CodecName(codec.kind)).c_str(),
        parts.size(), threads, reply_ms.back(), all_ms.back(),
        reply_ms.back() / all_ms.back());
  }
  std::sort(reply_ms.begin(), reply_ms.end());
  std::sort(all_ms.begin(), all_ms.end());
  const double r = reply_ms[reply_ms.size() / 2], a = all_ms[all_ms.size() / 2];
  std::printf(
      "{\"bench\": \"shard_pool\", \"median_last_reply_ms\": %.2f, "
      "\"median_all_done_ms\": %.2f, \"reply_over_all\": %.3f}\n",
      r, a, r / a);
  return 0;
}
