// 1-bit Adam against fp32 Adam on the single-process simulator: the same
// noisy quadratic, N workers and S shards, and for each run the final loss,
// the bytes each worker pushes per step in each phase (from the codecs'
// payload sizes) and the compression ratio. No network: this shows what the
// algorithm costs and saves before any daemon is involved.
//
//   onebit_sim_bench [--dim=D] [--workers=N] [--shards=S] [--steps=T]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compress/simulator.h"

namespace morse::compress {
namespace {

struct Options {
  uint64_t dim = 1 << 20;
  uint32_t workers = 4;
  uint32_t shards = 2;
  int steps = 300;
};

struct Result {
  double loss = 0;
  double seconds = 0;
  uint64_t warmup_bytes = 0, compressed_bytes = 0;  // per worker per step, up
};

uint64_t PushBytes(const Layout& layout, const CodecSpec& codec) {
  uint64_t bytes = 0;
  for (const Partition& p : layout.partitions())
    bytes += PayloadBytes(codec, p.range.size());
  return bytes;
}

Result Run(const Options& o, OptimizerKind optimizer) {
  AlgorithmConfig c;
  c.optimizer = optimizer;
  c.workers = o.workers;
  c.layout = {o.dim, o.shards, kDefaultBlockElems, 1u << 18};
  c.lr = {LrSchedule::Kind::kCosine, 0.02f, 0, o.steps, 0.0f};
  c.freeze_step = o.steps / 5;
  if (optimizer == OptimizerKind::kAdam) {
    c.up_codec.kind = c.down_codec.kind = CodecKind::kFp32;
    c.worker_feedback.kind = c.server_feedback.kind = FeedbackKind::kNone;
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> curvature(0.1f, 1.0f),
      target(-1.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.5f);
  std::vector<float> a(o.dim), t(o.dim);
  for (uint64_t j = 0; j < o.dim; ++j) {
    a[j] = curvature(rng);
    t[j] = target(rng);
  }
  auto sim = Simulator::Create(c, std::vector<float>(o.dim, 0.0f));
  if (!sim.ok()) {
    std::fprintf(stderr, "simulator: %s\n",
                 std::string(sim.status().message()).c_str());
    std::exit(2);
  }
  std::vector<std::vector<float>> g(o.workers, std::vector<float>(o.dim));
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < o.steps; ++step) {
    const auto x = sim->x();
    for (auto& gi : g) {
      for (uint64_t j = 0; j < o.dim; ++j)
        gi[j] = a[j] * (x[j] - t[j]) + noise(rng);
    }
    std::vector<absl::Span<const float>> views(g.begin(), g.end());
    if (absl::Status s = sim->Step(views); !s.ok()) {
      std::fprintf(stderr, "step %d: %s\n", step,
                   std::string(s.message()).c_str());
      std::exit(1);
    }
  }
  Result r;
  r.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const auto x = sim->x();
  for (uint64_t j = 0; j < o.dim; ++j)
    r.loss += 0.5 * a[j] * (x[j] - t[j]) * (x[j] - t[j]);
  r.warmup_bytes = PushBytes(sim->layout(), optimizer == OptimizerKind::kAdam
                                                ? c.up_codec
                                                : c.warmup_codec);
  r.compressed_bytes = PushBytes(sim->layout(), c.up_codec);
  return r;
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    const auto value = [&](const char* name) -> const char* {
      const size_t len = std::strlen(name);
      return std::strncmp(arg, name, len) == 0 && arg[len] == '='
                 ? arg + len + 1
                 : nullptr;
    };
    if (const char* v = value("--dim"))
      o.dim = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("--workers"))
      o.workers = std::atoi(v);
    else if (const char* v = value("--shards"))
      o.shards = std::atoi(v);
    else if (const char* v = value("--steps"))
      o.steps = std::atoi(v);
    else {
      std::fprintf(
          stderr,
          "usage: %s [--dim=D] [--workers=N] [--shards=S] [--steps=T]\n"
          "  --dim      parameters of the quadratic (default 1048576)\n"
          "  --workers  simulated workers (default 4)\n"
          "  --shards   simulated server shards (default 2)\n"
          "  --steps    steps; 1-bit Adam freezes v after the first 20%% "
          "(default 300)\n",
          argv[0]);
      std::exit(std::strcmp(arg, "--help") == 0 ? 0 : 2);
    }
  }
  return o;
}

}  // namespace
}  // namespace morse::compress

int main(int argc, char** argv) {
  using namespace morse::compress;
  const Options o = Parse(argc, argv);
  std::printf(
      "simulator: noisy quadratic, D=%llu, %u workers, %u shards, %d steps\n",
      static_cast<unsigned long long>(o.dim), o.workers, o.shards, o.steps);
  const Result adam = Run(o, OptimizerKind::kAdam);
  const Result onebit = Run(o, OptimizerKind::kOneBitAdam);
  const double ratio =
      double(adam.warmup_bytes) / double(onebit.compressed_bytes);
  std::printf("%-12s %14s %18s %18s %10s\n", "optimizer", "final loss",
              "push B/step warmup", "push B/step 1-bit", "seconds");
  std::printf("%-12s %14.6g %18llu %18s %10.2f\n", "adam (fp32)", adam.loss,
              static_cast<unsigned long long>(adam.warmup_bytes), "-",
              adam.seconds);
  std::printf("%-12s %14.6g %18llu %18llu %10.2f\n", "onebit_adam", onebit.loss,
              static_cast<unsigned long long>(onebit.warmup_bytes),
              static_cast<unsigned long long>(onebit.compressed_bytes),
              onebit.seconds);
  std::printf(
      "{\"adam_loss\":%.6g,\"onebit_loss\":%.6g,\"fp32_bytes_per_step\":%llu,"
      "\"onebit_bytes_per_step\":%llu,\"compression_ratio\":%.2f}\n",
      adam.loss, onebit.loss,
      static_cast<unsigned long long>(adam.warmup_bytes),
      static_cast<unsigned long long>(onebit.compressed_bytes), ratio);
  return 0;
}
