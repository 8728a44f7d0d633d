// Throughput of compress/'s hot loops against the memory-bandwidth ceiling
// measured in the same run.
//
// The first benchmark is a STREAM-like triad (a = b + s*c over 64 MiB
// arrays); its best rate in GB/s is the ceiling. Every other benchmark
// reports its effective bandwidth (the bytes the operation must read and
// write, divided by its time) and `vs_triad`, that rate over the ceiling.
// Single-threaded: the targets are per core.
//
//   build/tests/bench/compress_bench [--benchmark_filter=sign1]
//   MORSE_SIMD=scalar build/tests/bench/compress_bench  (codec benchmarks only)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "compress/clipping.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/halving_sum.h"
#include "compress/kernels.h"
#include "compress/lamb.h"
#include "compress/messages.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "compress/update_rules.h"

namespace morse::compress {
namespace {

constexpr size_t kElems = size_t{16} << 20;  // 64 MiB of fp32
constexpr uint32_t kBlock = kDefaultBlockElems;
double g_triad_gbps = 0.0;

// Buffers the system allocates for partitions are 64-byte aligned; so are
// the benchmark's outputs.
struct AlignedFloats {
  explicit AlignedFloats(size_t n)
      : data(static_cast<float*>(
            std::aligned_alloc(64, (4 * n + 63) / 64 * 64))),
        size(n) {}
  ~AlignedFloats() { std::free(data); }
  absl::Span<float> span() { return {data, size}; }
  float* data;
  size_t size;
};

std::vector<float> RandomVector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Runs `op` per iteration with manual timing and reports GB/s and vs_triad.
template <class Op>
void Measure(benchmark::State& state, double bytes_per_op, double elems_per_op,
             Op op) {
  double seconds = 0.0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    op();
    benchmark::ClobberMemory();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    state.SetIterationTime(t);
    seconds += t;
  }
  const double gbps = bytes_per_op * double(state.iterations()) / seconds / 1e9;
  state.counters["GB/s"] = gbps;
  state.counters["Gelem/s"] =
      elems_per_op * double(state.iterations()) / seconds / 1e9;
  state.counters["ns/elem"] =
      seconds / (elems_per_op * double(state.iterations())) * 1e9;
  if (g_triad_gbps > 0) state.counters["vs_triad"] = gbps / g_triad_gbps;
}

void BM_Triad(benchmark::State& state) {
  std::vector<float> a(kElems), b = RandomVector(kElems, 1),
                                c = RandomVector(kElems, 2);
  const float s = 3.0f;
  double seconds = 0.0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    float* __restrict pa = a.data();
    const float* __restrict pb = b.data();
    const float* __restrict pc = c.data();
    for (size_t i = 0; i < kElems; ++i) pa[i] = pb[i] + s * pc[i];
    benchmark::ClobberMemory();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    state.SetIterationTime(t);
    seconds += t;
    g_triad_gbps = std::max(g_triad_gbps, 12.0 * kElems / t / 1e9);
  }
  state.counters["GB/s"] =
      12.0 * kElems * double(state.iterations()) / seconds / 1e9;
  state.counters["best_GB/s"] = g_triad_gbps;
}
BENCHMARK(BM_Triad)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

// sign1 encode fused with ef, per kernel implementation: reads x and e,
// writes e and the payload.
void BM_Sign1EncodeEf(benchmark::State& state, const KernelTable* table) {
  if (table == nullptr) {
    state.SkipWithError("this CPU cannot run this implementation");
    return;
  }
  const std::vector<float> x = RandomVector(kElems, 3);
  std::vector<float> e(kElems, 0.0f);
  std::vector<float> scales(kElems / kBlock);
  std::vector<uint8_t> bits(kElems / 8);
  const double bytes = 12.0 * kElems + 4.0 * scales.size() + bits.size();
  Measure(state, bytes, kElems, [&] {
    table->sign1_encode(x.data(), e.data(), kElems, kBlock, ScaleKind::kL2,
                        {FeedbackKind::kEf, 1}, scales.data(), bits.data(),
                        nullptr);
  });
}

void BM_Sign1Decode(benchmark::State& state, const KernelTable* table) {
  if (table == nullptr) {
    state.SkipWithError("this CPU cannot run this implementation");
    return;
  }
  std::vector<float> scales(kElems / kBlock, 0.5f);
  AlignedFloats out(kElems);
  std::vector<uint8_t> bits(kElems / 8);
  std::mt19937 rng(4);
  for (uint8_t& b : bits) b = static_cast<uint8_t>(rng());
  const double bytes = 4.0 * kElems + 4.0 * scales.size() + bits.size();
  Measure(state, bytes, kElems, [&] {
    table->sign1_decode(scales.data(), bits.data(), kElems, kBlock, out.data);
  });
}

// Philox draws (stochastic rounding, the synthetic workload): writes out.
void BM_FillDraws(benchmark::State& state, const KernelTable* table) {
  if (table == nullptr) {
    state.SkipWithError("this CPU cannot run this implementation");
    return;
  }
  AlignedFloats out(kElems);
  Measure(state, 4.0 * kElems, kElems, [&] {
    table->fill_draws({7, 3, 1, 0}, out.data, kElems);
  });
}

// 1-bit LAMB's per-element loops (design.md 2.8) in the compression phase,
// per kernel implementation: the segment statistics read x, m, v and v'
// (kSumSegment elements a call, as LayerTotalsOf makes them); the x update
// reads x, m, v and writes x.
void BM_LambSegmentSums(benchmark::State& state, const KernelTable* table) {
  if (table == nullptr) {
    state.SkipWithError("this CPU cannot run this implementation");
    return;
  }
  const std::vector<float> x = RandomVector(kElems, 11),
                           m = RandomVector(kElems, 12);
  std::vector<float> v = RandomVector(kElems, 13),
                     v_fresh = RandomVector(kElems, 14);
  for (float& e : v) e = e * e;
  for (float& e : v_fresh) e = e * e;
  LambScalars s;
  s.frozen_variance = true;
  s.adam.bias_correction2 = 0.1f;
  std::vector<double> out(3 * (kElems / kSumSegment));
  Measure(state, 16.0 * kElems, kElems, [&] {
    for (size_t at = 0, k = 0; at < kElems; at += kSumSegment, k += 3) {
      table->lamb_segment_sums(s, &x[at], &m[at], &v[at], &v_fresh[at],
                               kSumSegment, &out[k]);
    }
  });
}

void BM_LambUpdateX(benchmark::State& state, const KernelTable* table) {
  if (table == nullptr) {
    state.SkipWithError("this CPU cannot run this implementation");
    return;
  }
  std::vector<float> x = RandomVector(kElems, 15);
  const std::vector<float> m = RandomVector(kElems, 16);
  std::vector<float> v = RandomVector(kElems, 17);
  for (float& e : v) e = e * e;
  LambScalars s;
  s.frozen_variance = true;
  Measure(state, 16.0 * kElems, kElems, [&] {
    table->lamb_update_x(s, 1e-7f, x.data(), m.data(), v.data(), kElems);
  });
}

// The codec API on the active kernels, for every codec; encode with ef
// where it applies (the error buffer is read and written).
void BM_Encode(benchmark::State& state, CodecKind kind, FeedbackKind feedback) {
  CodecSpec spec{kind, kBlock};
  const size_t n =
      kind == CodecKind::kTopK ? kElems / 8 : kElems;  // topk sorts
  const std::vector<float> x = RandomVector(n, 5);
  ErrorFeedback fb({feedback}, n, kBlock);
  std::vector<uint8_t> payload(PayloadBytes(spec, n));
  const double bytes =
      (feedback == FeedbackKind::kNone ? 4.0 : 12.0) * n + payload.size();
  Measure(state, bytes, n, [&] {
    benchmark::DoNotOptimize(
        fb.Compress(spec, 0, x, {}, absl::MakeSpan(payload)));
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_Decode(benchmark::State& state, CodecKind kind) {
  CodecSpec spec{kind, kBlock};
  const size_t n = kind == CodecKind::kTopK ? kElems / 8 : kElems;
  const std::vector<float> x = RandomVector(n, 6);
  std::vector<uint8_t> payload(PayloadBytes(spec, n));
  if (!Encode(spec, x, {}, absl::MakeSpan(payload)).ok()) std::abort();
  AlignedFloats out(n);
  const double bytes = 4.0 * n + payload.size();
  Measure(state, bytes, n,
          [&] { benchmark::DoNotOptimize(Decode(spec, payload, out.span())); });
  state.SetLabel(ActiveKernels().name);
}

// The server's average of N decoded payloads (N = 4 workers).
void BM_DecodeAverage4(benchmark::State& state, CodecKind kind) {
  CodecSpec spec{kind, kBlock};
  std::vector<std::vector<uint8_t>> payloads(4);
  for (int i = 0; i < 4; ++i) {
    payloads[i].resize(PayloadBytes(spec, kElems));
    if (!Encode(spec, RandomVector(kElems, 10 + i), {},
                absl::MakeSpan(payloads[i]))
             .ok()) {
      std::abort();
    }
  }
  std::vector<absl::Span<const uint8_t>> views(payloads.begin(),
                                               payloads.end());
  std::vector<float> out(kElems);
  const double bytes = 4.0 * kElems + 4.0 * payloads[0].size();
  Measure(state, bytes, kElems, [&] {
    benchmark::DoNotOptimize(DecodeAverage(spec, views, absl::MakeSpan(out)));
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_AdamStep(benchmark::State& state) {
  const std::vector<float> g = RandomVector(kElems, 7);
  std::vector<float> x = RandomVector(kElems, 8), m(kElems, 0.0f),
                     v(kElems, 0.0f);
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, true);
  Measure(state, 28.0 * kElems, kElems, [&] {
    AdamStep(s, g, absl::MakeSpan(x), absl::MakeSpan(m), absl::MakeSpan(v));
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_FrozenVarianceStep(benchmark::State& state) {
  const std::vector<float> c = RandomVector(kElems, 9);
  std::vector<float> x = RandomVector(kElems, 10), m(kElems, 0.0f),
                     v(kElems, 1.0f);
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, false);
  Measure(state, 20.0 * kElems, kElems, [&] {
    FrozenVarianceStep(s, c, absl::MakeSpan(x), absl::MakeSpan(m), v);
  });
  state.SetLabel(ActiveKernels().name);
}

// The other optimizers' update loops, through the functions the daemons
// call: 0/1 Adam's local step (reads g, x, m, u, v; writes x, m, u), its
// sync message (reads u, v; writes out) and its masked sync step (reads w,
// x, v; writes x, m); and 1-bit LAMB's masked moments in the compression
// phase (reads c, v, m, v'; writes m, v': 20 bytes); all in the kernel
// table.
void BM_ZeroOneLocalStep(benchmark::State& state) {
  const std::vector<float> g = RandomVector(kElems, 18);
  std::vector<float> x = RandomVector(kElems, 19), m(kElems, 0.0f),
                     u(kElems, 0.0f), v(kElems, 1.0f);
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, false);
  Measure(state, 32.0 * kElems, kElems, [&] {
    ZeroOneLocalStep(s, g, absl::MakeSpan(x), absl::MakeSpan(m),
                     absl::MakeSpan(u), v, true);
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_ZeroOneSyncMessage(benchmark::State& state) {
  const std::vector<float> u = RandomVector(kElems, 20),
                           m = RandomVector(kElems, 21);
  const std::vector<float> v(kElems, 1.0f);
  std::vector<float> out(kElems);
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, false);
  Measure(state, 16.0 * kElems, kElems,
          [&] { ZeroOneSyncMessage(s, 4e-3f, u, m, v, absl::MakeSpan(out)); });
  state.SetLabel(ActiveKernels().name);
}

// A sync step's local step and its message (the host engine's encode of
// a sync, compress::ZeroOneSyncLocalStep): reads g, x, m, u, v; writes m, u
// and the message (28 bytes). Against local_step (x not written: 28) plus
// sync_message (12), the two passes it replaces.
void BM_ZeroOneSyncLocalStep(benchmark::State& state) {
  const std::vector<float> g = RandomVector(kElems, 18);
  std::vector<float> x = RandomVector(kElems, 19), m(kElems, 0.0f),
                     u(kElems, 0.0f), v(kElems, 1.0f), out(kElems);
  const AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, false);
  Measure(state, 28.0 * kElems, kElems, [&] {
    ZeroOneSyncLocalStep(s, s, 4e-3f, g, absl::MakeSpan(x), absl::MakeSpan(m),
                         absl::MakeSpan(u), v, false, absl::MakeSpan(out));
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_ZeroOneSyncStep(benchmark::State& state) {
  const std::vector<float> w = RandomVector(kElems, 22);
  std::vector<float> x = RandomVector(kElems, 23), m(kElems, 0.0f);
  const std::vector<float> v(kElems, 1.0f);
  AdamScalars s = MakeAdamScalars({}, 1e-3f, 10, false);
  s.lr = 4e-3f;
  Measure(state, 20.0 * kElems, kElems, [&] {
    ZeroOneSyncStep(s, w, x, absl::MakeSpan(x), absl::MakeSpan(m), v,
                    /*mask=*/true);
  });
  state.SetLabel(ActiveKernels().name);
}

void BM_LambMomentsMasked(benchmark::State& state) {
  const std::vector<float> decoded = RandomVector(kElems, 24);
  std::vector<float> c = decoded, m = RandomVector(kElems, 25), v(kElems, 1.0f),
                     v_fresh(kElems, 1.0f);
  ReplyRule rule;
  rule.frozen_variance = true;
  rule.lamb = true;
  rule.mask = true;
  Measure(state, 20.0 * kElems, kElems, [&] {
    LambMoments(rule, c, absl::MakeSpan(m), absl::MakeSpan(v),
                absl::MakeSpan(v_fresh));
  });
  state.SetLabel(ActiveKernels().name);
}

// The data path's phases of one 1-bit Adam compression step (issue 12), at
// kElems elements, on this thread, with the zero-variance mask on (the
// default) and a few masked elements. Bytes are the least each phase must
// move per element (payloads at 1/8 byte an element plus their scales);
// what a phase moves beyond that shows as a lower vs_triad.
AlgorithmConfig PhaseConfig() {
  AlgorithmConfig c;
  c.optimizer = OptimizerKind::kOneBitAdam;
  c.workers = 2;
  c.layout = {kElems, 1, kBlock, kElems};
  c.freeze_step = 1;
  return c;
}
constexpr int64_t kPhaseStep = 3;  // in the compression phase
double PayloadPerElem() { return 1.0 / 8 + 4.0 / kBlock; }

// mode 1: every 1009th element has v = 0 (dead units), so every chunk has
// masked elements; mode 0: no element is masked; mode 2: the mask is off
// (mask_zero_variance false), the cost the default is held to.
AlgorithmConfig PhaseConfigOf(int mode) {
  AlgorithmConfig c = PhaseConfig();
  c.mask_zero_variance = mode != 2;
  return c;
}
struct PhaseState {
  explicit PhaseState(int mode)
      : config(PhaseConfigOf(mode)),
        replica(config, {0, kElems}),
        error(config.worker_feedback, kElems, kBlock) {
    const bool masked = mode == 1;
    const std::vector<float> m = RandomVector(kElems, 11),
                             v = RandomVector(kElems, 12);
    for (size_t j = 0; j < kElems; ++j) {
      replica.mutable_m()[j] = 0.1f * m[j];
      replica.mutable_v()[j] =
          masked && j % 1009 == 0 ? 0.0f : 1e-4f + 1e-4f * std::fabs(v[j]);
    }
  }
  AlgorithmConfig config;
  Replica replica;
  ErrorFeedback error;
};

// A worker's message: local momentum, error feedback, mask, scales and
// signs (EncodeWorkerMessage). Reads g, m, e, v; writes e and the payload.
void BM_PhaseWorkerEncode(benchmark::State& state) {
  PhaseState p(static_cast<int>(state.range(0)));
  const std::vector<float> g = RandomVector(kElems, 13);
  const SendRule rule = PlanSend(p.config, kPhaseStep, Direction::kUp, 0, 0);
  std::vector<uint8_t> payload(PayloadBytes(rule.codec, kElems));
  Measure(state, (20.0 + PayloadPerElem()) * kElems, kElems, [&] {
    if (!EncodeWorkerMessage(rule, p.replica, p.error, 0, g, 1.0f,
                             absl::MakeSpan(payload))
             .ok())
      std::abort();
  });
  state.SetLabel(ActiveKernels().name);
}

// A reply applied to x and m with the frozen v (Replica::ApplyReply): a
// worker's decode+update, and the same call is a shard's mirror update.
// Reads the payload, x, m, v; writes x and m.
void BM_PhaseApplyReply(benchmark::State& state) {
  PhaseState p(static_cast<int>(state.range(0)));
  const SendRule rule = PlanSend(p.config, kPhaseStep, Direction::kDown, 2, 0);
  std::vector<uint8_t> reply(PayloadBytes(rule.codec, kElems));
  if (!Encode(rule.codec, RandomVector(kElems, 14), {}, absl::MakeSpan(reply))
           .ok())
    std::abort();
  Measure(state, (20.0 + PayloadPerElem()) * kElems, kElems, [&] {
    if (!p.replica.ApplyReply(kPhaseStep, 0, kElems, reply).ok()) std::abort();
  });
  state.SetLabel(ActiveKernels().name);
}

// 1-bit LAMB's reply on a worker, partition by partition (262144 elements,
// layers of 2^20), as the host engine applies them: the moments from the
// decoded reply and the statistics of the partition's segments. Arg 0:
// ApplyReply, then LambSegments over the partition (a second pass); 1: the
// statistics in ApplyReply's pass (its lamb_segments). Reads the payload,
// x, m, v, v'; writes m and v'.
void BM_PhaseLambApplyReply(benchmark::State& state) {
  constexpr uint64_t kPartition = 262144;
  AlgorithmConfig c;
  c.optimizer = OptimizerKind::kOneBitLamb;
  c.workers = 2;
  c.layout = {kElems, 1, kBlock, kPartition};
  c.layers.assign(kElems >> 20, uint64_t{1} << 20);
  c.freeze_step = 1;
  Replica replica(c, {0, kElems});
  const std::vector<float> x = RandomVector(kElems, 31),
                           m = RandomVector(kElems, 32),
                           v = RandomVector(kElems, 33);
  for (size_t j = 0; j < kElems; ++j) {
    replica.x()[j] = x[j];
    replica.mutable_m()[j] = 0.1f * m[j];
    replica.mutable_v()[j] = 1e-4f + 1e-4f * std::fabs(v[j]);
    replica.mutable_v_fresh()[j] = replica.v()[j];
  }
  const SendRule rule = PlanSend(c, kPhaseStep, Direction::kDown, 2, 0);
  std::vector<uint8_t> reply(PayloadBytes(rule.codec, kPartition));
  if (!Encode(rule.codec, RandomVector(kPartition, 34), {},
              absl::MakeSpan(reply))
           .ok())
    std::abort();
  const bool fused = state.range(0) == 1;
  std::vector<double> segments;
  Measure(state, (20.0 + PayloadPerElem()) * kElems, kElems, [&] {
    for (uint64_t at = 0; at < kElems; at += kPartition) {
      if (!replica
               .ApplyReply(kPhaseStep, at, kPartition, reply, nullptr, 1.0f,
                           fused ? &segments : nullptr)
               .ok())
        std::abort();
      if (!fused)
        segments = replica.SegmentStats(kPhaseStep, {at, at + kPartition});
      benchmark::DoNotOptimize(segments.data());
    }
  });
  state.SetLabel(ActiveKernels().name);
}

// A shard's reply to N = 2 pushes over `threads` threads, each on its own
// partition (EncodeShardReply): reads the pushes, e and v; writes e and the
// reply. Gelem/s over threads is the shard's rate; per_core divides it.
void BM_PhaseShardReply(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  PhaseState p(static_cast<int>(state.range(1)));
  ErrorFeedback server(p.config.server_feedback, kElems, kBlock);
  const SendRule up = PlanSend(p.config, kPhaseStep, Direction::kUp, 0, 0);
  const SendRule down = PlanSend(p.config, kPhaseStep, Direction::kDown, 2, 0);
  const size_t per = kElems / threads / kBlock * kBlock;
  std::vector<std::vector<std::vector<uint8_t>>> pushes(threads);
  std::vector<std::vector<uint8_t>> replies(threads);
  for (int t = 0; t < threads; ++t) {
    const size_t n = t + 1 == threads ? kElems - per * t : per;
    for (uint32_t i = 0; i < 2; ++i) {
      pushes[t].emplace_back(PayloadBytes(up.codec, n));
      if (!Encode(up.codec, RandomVector(n, 15 + i), {},
                  absl::MakeSpan(pushes[t].back()))
               .ok())
        std::abort();
    }
    replies[t].resize(PayloadBytes(down.codec, n));
  }
  const auto run = [&](int t) {
    const size_t begin = per * t, n = t + 1 == threads ? kElems - begin : per;
    const std::vector<absl::Span<const uint8_t>> views(pushes[t].begin(),
                                                       pushes[t].end());
    if (!EncodeShardReply(down, up.codec, views, server, begin, n,
                          p.config.mask_zero_variance
                              ? p.replica.VarianceMask(begin, n)
                              : absl::Span<const float>(),
                          absl::MakeSpan(replies[t]))
             .ok()) {
      std::abort();
    }
  };
  // Threads that live across iterations, as a server's do (their scratch
  // arrays are allocated once).
  std::mutex mu;
  std::condition_variable cv;
  int generation = 0, done = 0;
  bool stop = false;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int seen = 0;;) {
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return stop || generation != seen; });
          if (stop) return;
          seen = generation;
        }
        run(t);
        std::lock_guard<std::mutex> lock(mu);
        ++done;
        cv.notify_all();
      }
    });
  }
  Measure(state, (12.0 + 3 * PayloadPerElem()) * kElems, kElems, [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++generation;
      done = 0;
    }
    cv.notify_all();
    run(0);
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == threads - 1; });
  });
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  for (auto& thread : pool) thread.join();
  state.counters["per_core_Gelem/s"] = state.counters["Gelem/s"] / threads;
  state.SetLabel(ActiveKernels().name);
}

// The norms a shard takes of each decoded reply when the step clips
// (design.md 2.6), partition by partition (2^18 elements, in cache as they
// are after the decode): arg 0 the sum of squares alone (a step that clips
// the average), 1 the sum of squares then the norms of order 1 and
// infinity in a second pass (the workers clip), 2 all of them in one pass
// (AllGradientNorms). Reads each element once per pass.
void BM_ClipReplyNorms(benchmark::State& state) {
  constexpr size_t kPartition = size_t{1} << 18;
  const std::vector<float> values = RandomVector(kElems, 21);
  const int how = static_cast<int>(state.range(0));
  double sink = 0.0;
  Measure(state, 4.0 * kElems, kElems, [&] {
    for (size_t at = 0; at < kElems; at += kPartition) {
      const absl::Span<const float> part =
          absl::MakeConstSpan(values).subspan(at, kPartition);
      if (how == 0) {
        sink += GradientSumOfSquares(part);
      } else if (how == 1) {
        sink += GradientSumOfSquares(part) + GradientOtherNorms(part).sum_abs;
      } else {
        const GradientNorms all = AllGradientNorms(part);
        sink += all.sum_of_squares + all.other.sum_abs;
      }
    }
  });
  benchmark::DoNotOptimize(sink);
}

void RegisterAll() {
  const std::pair<const char*, const KernelTable*> tables[] = {
      {"scalar", &ScalarKernels()},
      {"avx2", Avx2Kernels()},
      {"avx512", Avx512Kernels()}};
  const auto common = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
  };
  for (const auto& [name, table] : tables) {
    common(benchmark::RegisterBenchmark(
        (std::string("sign1_encode_ef/") + name).c_str(), BM_Sign1EncodeEf,
        table));
    common(benchmark::RegisterBenchmark(
        (std::string("sign1_decode/") + name).c_str(), BM_Sign1Decode, table));
    common(benchmark::RegisterBenchmark(
        (std::string("fill_draws/") + name).c_str(), BM_FillDraws, table));
    common(benchmark::RegisterBenchmark(
        (std::string("lamb_segment_sums/") + name).c_str(), BM_LambSegmentSums,
        table));
    common(benchmark::RegisterBenchmark(
        (std::string("lamb_update_x/") + name).c_str(), BM_LambUpdateX, table));
  }
  for (CodecKind kind :
       {CodecKind::kSign1, CodecKind::kInt8, CodecKind::kInt4, CodecKind::kFp16,
        CodecKind::kBf16, CodecKind::kFp32, CodecKind::kTopK}) {
    const std::string codec(CodecName(kind));
    common(benchmark::RegisterBenchmark(("encode/" + codec).c_str(), BM_Encode,
                                        kind, FeedbackKind::kNone));
    common(benchmark::RegisterBenchmark(("encode_ef/" + codec).c_str(),
                                        BM_Encode, kind, FeedbackKind::kEf));
    common(benchmark::RegisterBenchmark(("decode/" + codec).c_str(), BM_Decode,
                                        kind));
  }
  for (CodecKind kind :
       {CodecKind::kSign1, CodecKind::kInt8, CodecKind::kInt4}) {
    common(benchmark::RegisterBenchmark(
        ("average4/" + std::string(CodecName(kind))).c_str(), BM_DecodeAverage4,
        kind));
  }
  // Arg: the mask's mode (PhaseState: 0 none masked, 1 some, 2 off);
  // shard_reply: threads, mode.
  common(
      benchmark::RegisterBenchmark("phase/worker_encode", BM_PhaseWorkerEncode)
          ->Arg(0)
          ->Arg(1)
          ->Arg(2));
  common(benchmark::RegisterBenchmark("phase/apply_reply", BM_PhaseApplyReply)
             ->Arg(0)
             ->Arg(1)
             ->Arg(2));
  common(benchmark::RegisterBenchmark("phase/lamb_apply_reply",
                                      BM_PhaseLambApplyReply)
             ->Arg(0)
             ->Arg(1));
  const int cores =
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : std::set<int>{1, 2, cores}) {  // 1, 2 and all cores
    common(benchmark::RegisterBenchmark("phase/shard_reply", BM_PhaseShardReply)
               ->Args({threads, 0})
               ->Args({threads, 1})
               ->Args({threads, 2}));
  }
  common(benchmark::RegisterBenchmark("adam_step", BM_AdamStep));
  common(benchmark::RegisterBenchmark("frozen_variance_step",
                                      BM_FrozenVarianceStep));
  common(
      benchmark::RegisterBenchmark("zero_one/local_step", BM_ZeroOneLocalStep));
  common(benchmark::RegisterBenchmark("zero_one/sync_message",
                                      BM_ZeroOneSyncMessage));
  common(benchmark::RegisterBenchmark("zero_one/sync_local_step",
                                      BM_ZeroOneSyncLocalStep));
  common(
      benchmark::RegisterBenchmark("zero_one/sync_step", BM_ZeroOneSyncStep));
  common(benchmark::RegisterBenchmark("lamb/moments_masked",
                                      BM_LambMomentsMasked));
  common(benchmark::RegisterBenchmark("clip/reply_norms", BM_ClipReplyNorms)
             ->Arg(0)
             ->Arg(1)
             ->Arg(2));
}

}  // namespace
}  // namespace morse::compress

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  morse::compress::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
