// Workload: what a worker trains — the model's flat parameter vector, its
// deterministic initial value, and the local gradient of each step.
//
// Built-in workloads:
//   synthetic  0.5 * mean_j a_j (x_j - t_j)^2 plus per-(rank, step) uniform
//              gradient noise; a, t and the noise come from Philox draws, so
//              any D is cheap and every process can recompute any gradient.
//              Optionally every dead_every-th element gets no gradient at
//              all (a dead unit: v = 0, what the zero-variance mask is for).
//   mlp        a ReLU multilayer perceptron with softmax cross-entropy on a
//              CSV (label first) or libsvm data set; worker i trains on rows
//              r with r mod N == i; the passes are worker/mlp_backprop.h's
//              (CBLAS on the CPU, cuBLAS on the GPU).
// Each computes its gradient on any engine (worker/engine/engine.h) through
// GradientOn: its CPU code on the host, the engine's DeviceServices on a
// GPU.
// Not thread-safe; one per worker.
#ifndef MORSE_WORKER_WORKLOAD_H_
#define MORSE_WORKER_WORKLOAD_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/job_config.h"
#include "worker/engine/engine.h"
#include "worker/mlp_backprop.h"

namespace morse::worker {

class Workload {
 public:
  virtual ~Workload() = default;
  virtual uint64_t dim() const = 0;
  // The same x0 in every process of the job (a function of the seed).
  virtual void Initialize(absl::Span<float> x) const = 0;
  // Writes the local gradient at x for `step` and returns the local loss.
  virtual absl::StatusOr<double> Gradient(int64_t step,
                                          absl::Span<const float> x,
                                          absl::Span<float> grad) = 0;
  // Workloads whose gradient element j depends on x_j alone (synthetic)
  // compute it a range of elements at a time, so that a step's first
  // pushes overlap the rest of its gradient (GradientHook::GradientRange).
  virtual bool ComputesRanges() const { return false; }
  // grad[begin, end) at x; adds element j's loss term to loss_lanes[j % 4].
  // Ranges taken in increasing order give the floats and the lanes of one
  // call over everything (Gradient's loss is their sum over dim()).
  virtual absl::Status GradientRange(int64_t step, absl::Span<const float> x,
                                     absl::Span<float> grad, uint64_t begin,
                                     uint64_t end, double loss_lanes[4]);
  virtual uint64_t samples_per_step() const = 0;
  // Test-set accuracy in [0, 1], when the workload has a test set.
  virtual std::optional<double> TestAccuracy(
      absl::Span<const float> x) const = 0;
  // The gradient where `engine` keeps its model (Engine::SetWorkload calls
  // this). The default runs Gradient on the host engine and is UNIMPLEMENTED
  // on others; workloads with device code override it.
  virtual absl::StatusOr<std::unique_ptr<GradientHook>> GradientOn(
      Engine& engine);
};

// Worker `rank`'s workload. With job.local_ranks L > 1 the worker is a node
// of L local ranks (MakeNodeWorkload): local rank k trains as data rank
// rank * L + k of workers * L (its share of the mlp's rows, its synthetic
// noise).
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(
    const proto::JobSpec& job, uint32_t rank);

// A node's local ranks as one workload (worker/node_workload.cc): the
// gradient ((g_0 + g_1) + ... + g_{L-1}) / L in float, in local-rank order,
// as morse.torch's node group averages it; the loss the mean of theirs. On
// the host only.
std::unique_ptr<Workload> MakeNodeWorkload(
    std::vector<std::unique_ptr<Workload>> ranks);

// The mlp workload (worker/mlp_workload.cc), exposed so the GPU path can
// draw the same batches and run the same passes (worker/mlp_backprop.h).
struct MlpDataset {
  std::vector<float> features;  // rows x dim, row-major
  std::vector<uint32_t> labels;
  uint32_t dim = 0;
  size_t rows() const { return labels.size(); }
};

class MlpWorkload final : public Workload {
 public:
  MlpWorkload(const proto::JobSpec& job, uint32_t rank, MlpDataset train,
              std::optional<MlpDataset> test);
  uint64_t dim() const override;
  void Initialize(absl::Span<float> x) const override;
  absl::StatusOr<double> Gradient(int64_t step, absl::Span<const float> x,
                                  absl::Span<float> grad) override;
  uint64_t samples_per_step() const override { return spec_.batch_size; }
  std::optional<double> TestAccuracy(absl::Span<const float> x) const override;
  // On a GPU: cuBLAS and kernels through the engine's MlpOps; each step's
  // batch is drawn on the host (the CPU worker's draws) and copied over.
  absl::StatusOr<std::unique_ptr<GradientHook>> GradientOn(
      Engine& engine) override;

  // Layer widths: features, the hidden layers, classes.
  const std::vector<uint32_t>& widths() const { return widths_; }
  uint32_t batch_size() const { return spec_.batch_size; }
  // Step `step`'s batch_size() training rows (input row-major, batch_size()
  // x features) and their labels: the rows an uninterrupted run draws at
  // that step whatever was drawn before, so a resumed or restarted worker
  // sees the same data. Cheap for consecutive steps; a jump replays the
  // shuffles up to that step.
  void Batch(int64_t step, float* input, uint32_t* labels);

 private:
  // The order and cursor of step 0: rows shuffled by a generator seeded
  // from the job's seed and the rank.
  void Rewind();

  proto::MlpSpec spec_;
  uint64_t seed_;
  std::vector<uint32_t> widths_;  // before batch_, which is sized from it
  MlpDataset train_;
  std::optional<MlpDataset> test_;
  uint32_t rank_;
  std::mt19937_64 rng_;  // seeded by Rewind
  std::vector<size_t> order_;
  size_t cursor_ = 0;
  int64_t next_step_ = 0;  // the step whose batch the order and cursor give
  HostMlpBuffers batch_;   // the CPU path's buffers, batch_size() rows
  std::vector<uint32_t> labels_;
};

// The synthetic workload's gradient, exposed so tests can feed the simulator
// exactly what each worker computed.
class SyntheticWorkload final : public Workload {
 public:
  SyntheticWorkload(const proto::JobSpec& job, uint32_t rank);
  // Another rank's gradient of the same job, sharing a and t (the local
  // ranks of a node, NodeWorkload).
  SyntheticWorkload(const SyntheticWorkload& same_job, uint32_t rank);
  uint64_t dim() const override { return curvature_->size(); }
  void Initialize(absl::Span<float> x) const override;
  absl::StatusOr<double> Gradient(int64_t step, absl::Span<const float> x,
                                  absl::Span<float> grad) override;
  bool ComputesRanges() const override { return true; }
  absl::Status GradientRange(int64_t step, absl::Span<const float> x,
                             absl::Span<float> grad, uint64_t begin,
                             uint64_t end, double loss_lanes[4]) override;
  uint64_t samples_per_step() const override { return 1; }
  std::optional<double> TestAccuracy(absl::Span<const float>) const override {
    return std::nullopt;
  }
  // On a GPU: the engine's synthetic-gradient kernel, the same floats.
  absl::StatusOr<std::unique_ptr<GradientHook>> GradientOn(
      Engine& engine) override;
  // a and t of the formula (tests).
  absl::Span<const float> curvature() const { return *curvature_; }
  absl::Span<const float> target() const { return *target_; }

 private:
  uint64_t seed_;
  uint32_t rank_;
  float noise_;
  uint32_t
      dead_every_;  // elements j % dead_every == 0 get no gradient (0: none)
  std::shared_ptr<const std::vector<float>> curvature_, target_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_WORKLOAD_H_
