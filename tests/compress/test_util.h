// Helpers shared by the compress/ tests: seeded data with varied magnitudes,
// bit-exact comparisons, and a worker's replica with the shards' mirrors.
#ifndef MORSE_TESTS_COMPRESS_TEST_UTIL_H_
#define MORSE_TESTS_COMPRESS_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/step_plan.h"

namespace morse::compress::testing {

// Normal values scaled per 256-element run by 10^k, k in [-6, 3], with a few
// exact zeros and negative zeros, so scales and signs see every case.
inline std::vector<float> VariedData(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 3);
  std::vector<float> x(n);
  float magnitude = 1.0f;
  for (size_t j = 0; j < n; ++j) {
    if (j % 256 == 0)
      magnitude = std::pow(10.0f, static_cast<float>(exponent(rng)));
    x[j] = normal(rng) * magnitude;
    if (j % 97 == 5) x[j] = 0.0f;
    if (j % 101 == 7) x[j] = -0.0f;
  }
  return x;
}

// The scalars of a bias-corrected Adam step early in the run, with
// bound_update's max_ratio clamping a share of the frozen ratios.
inline AdamScalars CorrectedAdamScalars(float lr) {
  AdamScalars s;
  s.lr = lr;
  s.weight_decay = 0.01f;
  s.bias_correction1 = 0.271f;
  s.bias_correction2 = 0.00299f;
  s.max_ratio = 0.75f;
  return s;
}

inline bool SameBits(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
}

// The index of the first element whose bits differ, or -1.
inline long FirstBitDifference(absl::Span<const float> a,
                               absl::Span<const float> b) {
  for (size_t j = 0; j < a.size() && j < b.size(); ++j) {
    if (std::memcmp(&a[j], &b[j], 4) != 0) return static_cast<long>(j);
  }
  return a.size() == b.size() ? -1
                              : static_cast<long>(std::min(a.size(), b.size()));
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsFloatForTest(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A worker's replica of the whole model and one mirror per shard, each
// starting from x0.
struct Replicas {
  Replica worker;
  std::vector<Replica> mirrors;
};
inline Replicas ReplicasFrom(const AlgorithmConfig& c, const Layout& layout,
                             absl::Span<const float> x0) {
  Replicas replicas{Replica(c, {0, c.layout.dim}), {}};
  std::copy(x0.begin(), x0.end(), replicas.worker.x().begin());
  for (uint32_t s = 0; s < c.layout.shards; ++s) {
    const Range r = layout.shard_range(s);
    Replica& mirror = replicas.mirrors.emplace_back(c, r);
    std::copy(x0.begin() + r.begin, x0.begin() + r.end, mirror.x().begin());
  }
  return replicas;
}

// The reply of step `step` as one worker with fp32 both ways gets it (the
// reply is its message), applied by the worker and by each partition's
// shard mirror, each partition with its segment's values of `hypers`.
// `worker_segments` (onebit_lamb; null for none): set to the statistics of
// each partition's segments that the worker's ApplyReply gives.
inline absl::Status ApplyToWorkerAndMirrors(
    Replicas& replicas, const Layout& layout, int64_t step,
    absl::Span<const float> message, absl::Span<const StepHyper> hypers,
    std::vector<std::vector<double>>* worker_segments = nullptr) {
  if (worker_segments != nullptr)
    worker_segments->assign(layout.partitions().size(), {});
  const absl::Span<const uint8_t> bytes(
      reinterpret_cast<const uint8_t*>(message.data()), 4 * message.size());
  for (const Partition& p : layout.partitions()) {
    const auto part = bytes.subspan(4 * p.range.begin, 4 * p.range.size());
    const StepHyper* hyper = HyperOf(hypers, p.segment);
    for (Replica* r : {&replicas.worker, &replicas.mirrors[p.shard]}) {
      std::vector<double>* segments =
          r == &replicas.worker && worker_segments != nullptr
              ? &(*worker_segments)[p.id]
              : nullptr;
      if (absl::Status s = r->ApplyReply(step, p.range.begin, p.range.size(),
                                         part, hyper, 1.0f, segments);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace morse::compress::testing

#endif  // MORSE_TESTS_COMPRESS_TEST_UTIL_H_
