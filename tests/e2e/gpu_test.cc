// The GPU worker path (issue 4). Mixed jobs: rank 0 trains on the GPU
// (--device cuda: x, m, v, error buffer and gradient in device memory), rank
// 1 on the CPU, 2 shards, 1-bit Adam across the freeze step (with bias
// correction and the zero-variance mask: the synthetic workload has dead
// elements). With the synthetic workload both workers and both server
// mirrors must be bit-identical to the simulator after every step; with the mlp
// (cuBLAS) the GPU gradient must match the CPU's to rounding and both workers'
// models must stay identical. These skip, saying why, without a GPU; the
// --device checks at the end run everywhere.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/step_plan.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "proto/job_config.h"
#include "tests/compress/test_util.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/expected.h"
#include "worker/engine/engine.h"
#include "worker/workload.h"

namespace morse {
namespace {

using testing::JsonField;
using testing::ReadFile;

// `train_rows` and `test_rows` points of the same `classes` Gaussian blobs
// in `features` dimensions, as CSVs with the label first (dir/train.csv,
// dir/test.csv). Both sets come from one draw of the centers.
void WriteBlobs(const std::string& dir, int train_rows, int test_rows,
                int features, int classes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.6f);
  std::vector<std::vector<float>> centers(classes,
                                          std::vector<float>(features));
  for (auto& c : centers) {
    for (float& v : c) v = noise(rng) * 2.0f;
  }
  for (const auto& [name, rows] :
       {std::pair<const char*, int>{"/train.csv", train_rows},
        std::pair<const char*, int>{"/test.csv", test_rows}}) {
    std::ofstream out(dir + name);
    for (int r = 0; r < rows; ++r) {
      const int label = r % classes;
      out << label;
      for (int f = 0; f < features; ++f)
        out << "," << centers[label][f] + noise(rng);
      out << "\n";
    }
  }
}

// Servers, then rank 0 on the GPU and rank 1 on the CPU, both logging
// checksums; waits for both and stops the servers.
void RunGpuAndCpuWorker(testing::Cluster& cluster, bool state_logs) {
  cluster.StartServers(state_logs);
  cluster.AddWorkerArgs({"--device=cuda"});
  cluster.StartWorker(0, /*checksums=*/true);
  cluster.AddWorkerArgs({"--device=cpu"});
  cluster.StartWorker(1, /*checksums=*/true);
  std::string failure;
  const bool finished = cluster.WaitWorkers(absl::Seconds(180), &failure);
  cluster.StopServers();
  ASSERT_TRUE(finished) << failure;
  const std::string log = ReadFile(cluster.worker_log(0));
  ASSERT_NE(log.find("gradient on "), std::string::npos) << log;
}

std::string MlpConfig(const std::string& dir, int workers, int steps) {
  return absl::StrCat(R"(
    shards: 2
    mlp {
      train_path: ")",
                      dir, R"(/train.csv"
      test_path: ")",
                      dir, R"(/test.csv"
      features: 20
      classes: 4
      hidden: 48
      hidden: 24
      batch_size: 64
    }
    optimizer: "onebit_adam"
    adam { eps: 1e-4 }
    lr { lr: 0.003 }
    freeze_step: 15
    block_elems: 256
    partition_elems: 1024
    seed: 5
    workers: )",
                      workers, "\n    steps: ", steps, "\n");
}

// The mixed jobs' common part: 2 workers and 2 shards on the synthetic
// model (300007 elements, every 11th dead: v = 0, masked); `rest` adds the
// optimizer, its settings and the steps, `synthetic` more workload fields.
std::string MixedJob(const std::string& rest,
                     const std::string& synthetic = "") {
  return absl::StrCat(
      "workers: 2\nshards: 2\nsynthetic { dim: 300007 noise: 0.3 dead_every: "
      "11 ",
      synthetic,
      " }\nlr { lr: 0.01 }\nblock_elems: 256\npartition_elems: 65536\nseed: "
      "3\n",
      rest);
}

// Rank 0 on the GPU and rank 1 on the CPU, 2 shards: both workers and both
// shard mirrors bit-identical to the simulator after every step.
void ExpectMixedJobBitIdentical(const std::string& config) {
  auto job = proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const testing::Expected expected = testing::Simulate(*job);
  testing::Cluster cluster(config, 2, 2);
  ASSERT_NO_FATAL_FAILURE(RunGpuAndCpuWorker(cluster, /*state_logs=*/true));
  for (int r = 0; r < 2; ++r) {
    // Each worker's own: they differ after zero_one_adam's local steps.
    const auto got = JsonField(ReadFile(cluster.worker_metrics(r)), "checksum");
    ASSERT_EQ(got.size(), expected.worker[r].size()) << "worker " << r;
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.worker[r][t])
          << (r == 0 ? "GPU" : "CPU") << " worker differs at step " << t;
    }
  }
  for (int s = 0; s < 2; ++s) {
    const auto got =
        JsonField(ReadFile(cluster.state_log(s)), "mirror_checksum");
    ASSERT_EQ(got.size(), expected.shard[s].size());
    for (size_t t = 0; t < got.size(); ++t) {
      ASSERT_EQ(got[t], expected.shard[s][t])
          << "shard " << s << " differs at step " << t;
    }
  }
}

TEST(GpuTest, CpuAndGpuWorkersStayBitIdenticalAcrossTheFreeze) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  ExpectMixedJobBitIdentical(MixedJob(R"(
    optimizer: "onebit_adam"
    adam { eps: 1e-4 }
    freeze_step: 10
    steps: 50
  )"));
}

// Gradient clipping (design.md 2.6) on a GPU worker: the averaged gradient
// clipped in the warmup (the shards' norms, the replies scaled on the GPU),
// the worker's own gradient after the freeze (its norm summed on the GPU);
// then 0/1 Adam's local steps clipped too, and 1-bit LAMB (its warmup's
// commit carries the norm with the layers' values). The norms are far
// above 0.5, so every step clips.
TEST(GpuTest, ClippingOnTheGpuStaysBitIdentical) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  const std::string clipped =
      "adam { eps: 1e-4 }\nclip_grad_norm: 0.5\nsteps: 20\n";
  ExpectMixedJobBitIdentical(
      MixedJob(clipped + "optimizer: \"onebit_adam\"\nfreeze_step: 8\n"));
  ExpectMixedJobBitIdentical(MixedJob(clipped + R"(
    optimizer: "zero_one_adam"
    zero_one_adam { var_freeze_step: 6 var_update_scaler: 2 local_step_scaler: 3 local_step_clipper: 4 }
  )"));
  ExpectMixedJobBitIdentical(
      MixedJob(clipped + "optimizer: \"onebit_lamb\"\nfreeze_step: 8\n",
               "layer_elems: 70000"));
}

// zero_one_adam (design.md 2.7) through every phase on a GPU worker:
// variance steps, 1-bit steps between them, then local steps and syncs of
// growing intervals (the anchor, u and the learning-rate sum on the device).
TEST(GpuTest, ZeroOneAdamOnTheGpuStaysBitIdenticalThroughEveryPhase) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  ExpectMixedJobBitIdentical(MixedJob(R"(
    optimizer: "zero_one_adam"
    zero_one_adam { var_freeze_step: 12 var_update_scaler: 2 local_step_scaler: 4 local_step_clipper: 4 }
    adam { eps: 1e-4 weight_decay: 0.01 }
    steps: 40
  )"));
}

// onebit_lamb (design.md 2.8) across the freeze on a GPU worker: layers
// that cross partitions and shards, the layer sums from the GPU's segments.
TEST(GpuTest, OneBitLambOnTheGpuStaysBitIdenticalAcrossTheFreeze) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  ExpectMixedJobBitIdentical(MixedJob(R"(
    optimizer: "onebit_lamb"
    adam { eps: 1e-4 weight_decay: 0.01 }
    freeze_step: 10
    steps: 30
  )",
                                      "layer_elems: 70000"));
}

// The CUDA engine's Load and Store carry x, m, v, the error buffer and
// every array the optimizer names (Optimizer::State: onebit_lamb's v' and
// layer state; IntervalState: zero_one_adam's anchor, u and lr sums, with
// the interval's last local step) to the device and back bit for bit: a
// replica's state loaded into the engine and stored into a fresh replica.
TEST(GpuTest, LoadAndStoreKeepEveryArrayOfTheOptimizer) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  for (const char* optimizer : {"zero_one_adam", "onebit_lamb"}) {
    SCOPED_TRACE(optimizer);
    const bool lamb = std::strcmp(optimizer, "onebit_lamb") == 0;
    auto job = proto::ParseJobConfig(
        MixedJob(absl::StrCat("optimizer: \"", optimizer, "\"\nsteps: 30\n",
                              lamb ? "freeze_step: 10\n" : ""),
                 lamb ? "layer_elems: 70000" : ""),
        proto::ConfigFormat::kText);
    ASSERT_TRUE(job.ok()) << job.status();
    const compress::AlgorithmConfig& c = job->algorithm;
    const uint64_t dim = c.layout.dim;
    auto layout = compress::Layout::Create(c.layout);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const auto values = [dim](float k) {
      std::vector<float> out(dim);
      for (uint64_t j = 0; j < dim; ++j) out[j] = std::sin(k * (j + 1));
      return out;
    };
    compress::Replica replica(c, {0, dim});
    std::copy_n(values(0.1f).begin(), dim, replica.x().begin());
    std::copy_n(values(0.2f).begin(), dim, replica.mutable_m().begin());
    const std::vector<float> v = [&] {
      std::vector<float> out = values(0.3f);
      for (float& e : out) e = e * e;
      return out;
    }();
    std::copy_n(v.begin(), dim, replica.mutable_v().begin());
    std::vector<compress::NamedState> own = replica.SaveState(0, dim);
    for (compress::NamedState& array : own) {
      if (array.values.size() == dim) array.values = v;  // v' as v
    }
    ASSERT_TRUE(replica.RestoreState(0, dim, own).ok());
    std::vector<compress::NamedState> interval = replica.SaveInterval();
    for (compress::NamedState& array : interval) {
      array.values = array.name == "anchor" ? values(0.4f)
                     : array.name == "u"
                         ? values(0.5f)
                         : std::vector<float>(array.values.size(), 0.0125f);
    }
    ASSERT_TRUE(replica.RestoreInterval(interval, 17).ok());
    compress::ErrorFeedback error(c.worker_feedback, dim, c.layout.block_elems);
    ASSERT_TRUE(error.Restore(values(0.6f)).ok());

    auto engine =
        worker::CreateEngine("cuda", {&c, &*layout, &replica, &error});
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE((*engine)->Load(replica, error).ok());
    compress::Replica stored(c, {0, dim});
    compress::ErrorFeedback stored_error(c.worker_feedback, dim,
                                         c.layout.block_elems);
    ASSERT_TRUE((*engine)->Store(stored, stored_error).ok());

    EXPECT_TRUE(compress::testing::SameBits(stored.x(), replica.x()));
    EXPECT_TRUE(compress::testing::SameBits(stored.m(), replica.m()));
    EXPECT_TRUE(compress::testing::SameBits(stored.v(), replica.v()));
    std::vector<float> e(dim), stored_e(dim);
    error.Read(0, absl::MakeSpan(e));
    stored_error.Read(0, absl::MakeSpan(stored_e));
    EXPECT_TRUE(compress::testing::SameBits(stored_e, e));
    for (const auto& [got, want] :
         {std::pair{stored.SaveState(0, dim), replica.SaveState(0, dim)},
          std::pair{stored.SaveInterval(), replica.SaveInterval()}}) {
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].name, want[i].name);
        EXPECT_TRUE(compress::testing::SameBits(got[i].values, want[i].values))
            << want[i].name;
      }
    }
    EXPECT_EQ(stored.last_local_step(), replica.last_local_step());
    // A replica with no interval under way (its anchor and u empty, its
    // sums held) comes back without one.
    compress::Replica fresh(c, {0, dim});
    ASSERT_TRUE((*engine)->Load(fresh, error).ok());
    compress::Replica none(c, {0, dim});
    ASSERT_TRUE(none.RestoreInterval(interval, 17).ok());  // to be replaced
    ASSERT_TRUE((*engine)->Store(none, stored_error).ok());
    const std::vector<compress::NamedState> want = fresh.SaveInterval(),
                                            got = none.SaveInterval();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(compress::testing::SameBits(got[i].values, want[i].values))
          << want[i].name << " (no interval): " << got[i].values.size()
          << " values";
    }
    EXPECT_EQ(none.last_local_step(), -1);
  }
}

TEST(GpuTest, MlpGradientOnTheGpuMatchesTheCpu) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  char pattern[] = "/tmp/morse-gpu-mlp-XXXXXX";
  const std::string dir = mkdtemp(pattern);
  WriteBlobs(dir, 500, 100, 20, 4, 1);
  auto job =
      proto::ParseJobConfig(MlpConfig(dir, 1, 20), proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  // Two copies of the workload draw the same batches.
  auto cpu = worker::MakeWorkload(*job, 0);
  auto gpu = worker::MakeWorkload(*job, 0);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const uint64_t dim = (*cpu)->dim();
  auto layout = compress::Layout::Create(job->algorithm.layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  compress::Replica replica(job->algorithm, {0, dim});
  (*cpu)->Initialize(replica.x());
  // Off the biases' exact zeros, so that the ReLUs see both signs.
  for (size_t j = 0; j < dim; ++j)
    replica.x()[j] += 0.01f * std::sin(0.37f * j);
  compress::ErrorFeedback error(job->algorithm.worker_feedback, dim,
                                job->algorithm.layout.block_elems);
  auto engine = worker::CreateEngine(
      "cuda", {&job->algorithm, &*layout, &replica, &error});
  ASSERT_TRUE(engine.ok()) << engine.status();
  // Every partition in flight by default (each has its own staging slot),
  // and the send stream at high priority unless MORSE_SEND_STREAM_PRIORITY
  // says normal.
  EXPECT_EQ((*engine)->DefaultWindow(130), 130u);
  EXPECT_EQ((*engine)->DefaultWindow(0), 1u);
  if (std::getenv("MORSE_SEND_STREAM_PRIORITY") == nullptr) {
    EXPECT_EQ((*engine)->description().find("normal priority"),
              std::string::npos)
        << (*engine)->description();
  }
  std::vector<float> gpu_grad(dim), cpu_grad(dim);
  ASSERT_TRUE((*engine)->Load(replica, error).ok());
  ASSERT_TRUE((*engine)->SetWorkload(**gpu).ok());
  for (int step = 0; step < 5; ++step) {
    auto gpu_loss = (*engine)->Gradient(step);
    ASSERT_TRUE(gpu_loss.ok()) << gpu_loss.status();
    ASSERT_TRUE((*engine)->ReadGradient(absl::MakeSpan(gpu_grad)).ok());
    auto cpu_loss =
        (*cpu)->Gradient(step, replica.x(), absl::MakeSpan(cpu_grad));
    ASSERT_TRUE(cpu_loss.ok());
    EXPECT_NEAR(*gpu_loss, *cpu_loss, 1e-5 * std::fabs(*cpu_loss))
        << "step " << step;
    float largest = 0;
    for (float g : cpu_grad) largest = std::max(largest, std::fabs(g));
    ASSERT_GT(largest, 0.0f);
    for (size_t j = 0; j < dim; ++j) {
      ASSERT_NEAR(gpu_grad[j], cpu_grad[j], 1e-4f * largest)
          << "step " << step << ", parameter " << j << " of " << dim;
    }
  }
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

TEST(GpuTest, MixedMlpJobKeepsBothReplicasIdentical) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  char pattern[] = "/tmp/morse-gpu-mlp-XXXXXX";
  const std::string dir = mkdtemp(pattern);
  WriteBlobs(dir, 800, 200, 20, 4, 1);
  testing::Cluster cluster(MlpConfig(dir, 2, 60), 2, 2);
  ASSERT_NO_FATAL_FAILURE(RunGpuAndCpuWorker(cluster, /*state_logs=*/false));
  const std::string gpu_log = ReadFile(cluster.worker_log(0));
  // Every replica applies the same replies with bit-identical updates.
  const auto gpu = JsonField(ReadFile(cluster.worker_metrics(0)), "checksum");
  const auto cpu = JsonField(ReadFile(cluster.worker_metrics(1)), "checksum");
  ASSERT_EQ(gpu.size(), 60u);
  ASSERT_EQ(gpu, cpu);
  // And the job learns the blobs.
  const auto accuracy = JsonField(gpu_log, "test_accuracy");
  ASSERT_FALSE(accuracy.empty()) << gpu_log;
  EXPECT_GT(std::stod(accuracy.back()), 0.9) << gpu_log;
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

// A step that averages whose gradient the workers amended (design.md 2.6,
// "Edits after the clip"), on the GPU engine and the host's: a reply the
// GPU engine staged is read back where it lies on the host (what
// Session::AverageGradient decodes), and partition 0's amended values
// applied in place of its reply, the others' replies as they came, leave
// x, m and v with the host replica's bits, over three fp32 Adam steps.
TEST(GpuTest, AnAmendedStepOnTheGpuHasTheHostsBits) {
  auto device = kernels::DeviceDescription();
  if (!device.ok())
    GTEST_SKIP() << "no GPU here: " << device.status().message();
  auto job = proto::ParseJobConfig(
      "workers: 2 shards: 1 synthetic { dim: 3000 } lr { lr: 0.01 } "
      "steps: 3 optimizer: \"adam\" block_elems: 16 partition_elems: 1024",
      proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  const compress::AlgorithmConfig& config = job->algorithm;
  const uint64_t dim = config.layout.dim;
  auto layout = compress::Layout::Create(config.layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  compress::Replica host_replica(config, {0, dim}),
      gpu_replica(config, {0, dim});
  for (uint64_t j = 0; j < dim; ++j) {
    host_replica.x()[j] = gpu_replica.x()[j] =
        0.001f * static_cast<float>(j % 97) - 0.05f;
  }
  compress::ErrorFeedback host_error(config.worker_feedback, dim,
                                     config.layout.block_elems),
      gpu_error(config.worker_feedback, dim, config.layout.block_elems);
  auto host = worker::CreateEngine(
      "cpu", {&config, &*layout, &host_replica, &host_error});
  auto gpu = worker::CreateEngine(
      "cuda", {&config, &*layout, &gpu_replica, &gpu_error});
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->Load(gpu_replica, gpu_error).ok());
  for (int64_t step = 0; step < 3; ++step) {
    (*gpu)->BeginReplies(step);
    for (const compress::Partition& p : layout->partitions()) {
      const compress::CodecSpec codec = compress::PlanReply(config, step).codec;
      std::vector<float> values(p.range.size()), amended(p.range.size());
      for (size_t j = 0; j < values.size(); ++j) {
        values[j] =
            0.01f * static_cast<float>((j * 7 + step * 13 + p.id) % 23) - 0.1f;
        amended[j] = 0.5f * values[j] + 0.003f;
      }
      std::string reply(compress::PayloadBytes(codec, values.size()), '\0');
      const absl::Span<uint8_t> out(reinterpret_cast<uint8_t*>(reply.data()),
                                    reply.size());
      ASSERT_TRUE(compress::Encode(codec, values, {}, out).ok());
      const absl::Span<const uint8_t> bytes = out;
      ASSERT_TRUE((*gpu)->StageReply(step, p, bytes).ok());
      auto staged = (*gpu)->StagedReply(p);
      ASSERT_TRUE(staged.ok()) << staged.status();
      ASSERT_TRUE(std::equal(staged->begin(), staged->end(), bytes.begin(),
                             bytes.end()))
          << "step " << step << ", partition " << p.id;
      if (p.id == 0) {
        ASSERT_TRUE(
            (*host)->ApplyAmended(step, p, amended, /*hyper=*/nullptr).ok());
        ASSERT_TRUE(
            (*gpu)->ApplyAmended(step, p, amended, /*hyper=*/nullptr).ok());
      } else {
        ASSERT_TRUE((*host)->ApplyReply(step, p, bytes).ok());
        ASSERT_TRUE((*gpu)->ApplyStagedReply(step, p).ok());
      }
      EXPECT_EQ((*gpu)->StagedReply(p).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    ASSERT_TRUE((*gpu)->FinishApplies().ok());
  }
  ASSERT_TRUE((*gpu)->Store(gpu_replica, gpu_error).ok());
  for (auto [name, a, b] :
       {std::tuple{"x", absl::Span<const float>(host_replica.x()),
                   absl::Span<const float>(gpu_replica.x())},
        std::tuple{"m", absl::Span<const float>(host_replica.m()),
                   absl::Span<const float>(gpu_replica.m())},
        std::tuple{"v", absl::Span<const float>(host_replica.v()),
                   absl::Span<const float>(gpu_replica.v())}}) {
    ASSERT_EQ(std::memcmp(a.data(), b.data(), 4 * dim), 0)
        << name << " differs between the GPU and the host";
  }
}

// Runs everywhere: what --device does with and without a GPU.
TEST(DeviceFlagTest, AutoFallsBackAndCudaRefusesWithoutAGpu) {
  const bool have_gpu = kernels::DeviceDescription().ok();
  const std::string config = R"(
    workers: 1
    shards: 1
    synthetic { dim: 5000 }
    optimizer: "onebit_adam"
    lr { lr: 0.01 }
    freeze_step: 2
    steps: 4
  )";
  {
    testing::Cluster cluster(config, 1, 1);
    cluster.StartServers(false);
    cluster.AddWorkerArgs({"--device=auto"});
    cluster.StartWorker(0, false);
    std::string failure;
    ASSERT_TRUE(cluster.WaitWorkers(absl::Seconds(60), &failure)) << failure;
    cluster.StopServers();
    const std::string log = ReadFile(cluster.worker_log(0));
    EXPECT_NE(log.find(have_gpu ? "gradient on " : "training on the CPU ("),
              std::string::npos)
        << log;
    const auto used = JsonField(log, "device");
    ASSERT_FALSE(used.empty()) << log;
    EXPECT_EQ(used.back() == "cpu", !have_gpu) << log;
  }
  {
    testing::Cluster cluster(config, 1, 1);
    cluster.StartServers(false);
    cluster.AddWorkerArgs({"--device=cuda"});
    cluster.StartWorker(0, false);
    std::string failure;
    const bool ok = cluster.WaitWorkers(absl::Seconds(60), &failure);
    cluster.StopServers();
    if (have_gpu) {
      EXPECT_TRUE(ok) << failure;
    } else {
      ASSERT_FALSE(ok);
      EXPECT_NE(failure.find("exited 2"), std::string::npos) << failure;
      EXPECT_NE(failure.find("--device cuda: "), std::string::npos) << failure;
    }
  }
  {
    testing::Cluster cluster(config, 1, 1);
    cluster.StartServers(false);
    cluster.AddWorkerArgs({"--device=tpu"});
    cluster.StartWorker(0, false);
    std::string failure;
    ASSERT_FALSE(cluster.WaitWorkers(absl::Seconds(60), &failure));
    cluster.StopServers();
    EXPECT_NE(failure.find("use auto, cpu or cuda"), std::string::npos)
        << failure;
  }
}

}  // namespace
}  // namespace morse
