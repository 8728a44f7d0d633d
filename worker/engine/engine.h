// Engine: where a worker keeps x, m, v, its error buffer and the gradient,
// and the per-step work that touches them (DESIGN 2.1-2.4): encode a
// partition into the bytes a push carries, apply a reply, move the state in
// and out. One interface, one implementation per place, each in its own
// folder with the same file names (as gloo does for its transports):
//
//   worker/engine/host/engine.{h,cc}  the CPU: the session's own replica and
//                                     error buffer, compress/'s kernels
//   worker/engine/cuda/engine.{h,cc}  a GPU: device arrays (its own or the
//                                     caller's, e.g. PyTorch tensors),
//                                     kernels/, pinned staging buffers
//
// chosen at run time by name (CreateEngine). Both read the step's rules from
// compress/replica.h (PlanSend, PlanReply) and give the same bits, so CPU
// and GPU workers share a job (DESIGN 2.5).
//
// Workloads compute their gradient on an engine through a hook
// (Workload::GradientOn) built from the engine's DeviceServices, so neither
// side knows the other's concrete type.
//
// Encode runs on the thread that drives the step; ApplyReply on gRPC threads
// (concurrently for disjoint partitions on the host; serialized on a GPU).
#ifndef MORSE_WORKER_ENGINE_ENGINE_H_
#define MORSE_WORKER_ENGINE_ENGINE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/compute_pool.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "worker/mlp_backprop.h"

namespace morse::worker {

class Workload;

// What a workload may use on an engine's device to compute its gradient
// there. Pointers are the device's memory.
class DeviceServices {
 public:
  virtual ~DeviceServices() = default;
  // Device memory of `bytes`, owned by the engine (freed with it).
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // Host -> device, ordered before the work enqueued after it; `host` may be
  // reused when this returns.
  virtual absl::Status CopyIn(void* device, const void* host, size_t bytes) = 0;
  // The mlp's six array operations on this device (worker/mlp_backprop.h).
  virtual MlpOps& mlp_ops() = 0;
  // The synthetic workload's gradient (SyntheticWorkload: the same floats as
  // its CPU formula): grad = a*(x - t) + noise*(2u - 1), u its Philox draw of
  // (seed, step, rank), and +0 where j % dead_every == 0 (0: nowhere);
  // returns the mean loss.
  virtual absl::StatusOr<double> SyntheticGradient(
      uint64_t seed, int64_t step, uint32_t rank, float noise,
      uint32_t dead_every, const float* a, const float* t, const float* x,
      float* grad, size_t n) = 0;
};

// A workload's gradient computed where an engine keeps its model: x and grad
// are the engine's arrays (dim floats; device memory on a GPU).
class GradientHook {
 public:
  virtual ~GradientHook() = default;
  virtual absl::StatusOr<double> Gradient(int64_t step, const float* x,
                                          float* grad) = 0;
  // Hooks of element-wise gradients (Workload::ComputesRanges) also compute
  // grad[begin, end), adding element j's loss term to loss_lanes[j % 4].
  virtual bool ComputesRanges() const { return false; }
  virtual absl::Status GradientRange(int64_t step, const float* x, float* grad,
                                     uint64_t begin, uint64_t end,
                                     double loss_lanes[4]);
  // The mean loss of lanes filled over all n elements.
  static double MeanLoss(const double loss_lanes[4], uint64_t n) {
    return (loss_lanes[0] + loss_lanes[1] + (loss_lanes[2] + loss_lanes[3])) /
           static_cast<double>(n);
  }
};

// A caller's device arrays of dim floats (PyTorch tensors): a GPU engine's
// parameters live in `x` and it encodes the gradient in `grad`. Null: the
// engine allocates its own.
struct DeviceArrays {
  float* x = nullptr;
  float* grad = nullptr;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // "cpu" or "cuda".
  virtual const std::string& kind() const = 0;
  // "cpu", or the GPU's ("NVIDIA H100 ... (sm_90, 79 GiB)").
  virtual const std::string& description() const = 0;
  // Null on the host: workloads use their CPU code there.
  virtual DeviceServices* device() = 0;
  // Partitions a worker keeps in flight where the job's config leaves
  // `window` out, for a model of `partitions`.
  virtual uint32_t DefaultWindow(size_t partitions) const = 0;

  // The session's host replica and error buffer are the reference copies:
  // Load brings them into the engine, Store writes the engine's state back
  // (both nothing on the host, whose state they are).
  virtual absl::Status Load(const compress::Replica& replica,
                            const compress::ErrorFeedback& error) = 0;
  virtual absl::Status Store(compress::Replica& replica,
                             compress::ErrorFeedback& error) = 0;

  // Where the step's gradient comes from: the workload's hook (SetWorkload,
  // then Gradient each step), or the caller's memory: a host array for the
  // host engine (SetHostGradient, kept alive for the step), the device array
  // given at creation for a GPU engine.
  absl::Status SetWorkload(
      Workload& workload);  // defined in worker/workload.cc
  absl::StatusOr<double> Gradient(int64_t step);
  // The gradient a range at a time, where the hook can (GradientHook::
  // ComputesRanges): the trainer pushes each partition as soon as its range
  // is computed. GradientRangeLoss is the mean loss of lanes filled by
  // ranges covering every element.
  bool ComputesGradientRanges() const;
  absl::Status GradientRange(int64_t step, uint64_t begin, uint64_t end,
                             double loss_lanes[4]);
  double GradientRangeLoss(const double loss_lanes[4]);
  virtual absl::Status SetHostGradient(absl::Span<const float> grad) = 0;
  // Device -> host copy of the gradient the next Encode reads (tests).
  virtual absl::Status ReadGradient(absl::Span<float> grad) = 0;

  // The next Encode waits for the work already enqueued on `stream` (a
  // cudaStream_t of the caller's, e.g. PyTorch's current stream) without
  // blocking the host; nothing on the host.
  virtual absl::Status WaitFor(void* stream) = 0;
  // The push payload of partition `p` for `step` from worker `rank` (the
  // sender's rule, compress::PlanSend, with the partition's `hyper` when the
  // workers set one), from the gradient scaled by `grad_scale` (the
  // worker's own clip factor, compress::ClipsLocally).
  virtual absl::Status Encode(int64_t step, uint32_t rank,
                              const compress::Partition& p,
                              std::string* payload, float grad_scale = 1.0f,
                              const compress::StepHyper* hyper = nullptr) = 0;
  // Encode in two halves, for an engine whose device works behind the host:
  // StartEncode enqueues partition p's encode (of the gradient as the work
  // enqueued so far leaves it; see WaitFor) and returns at once, and the
  // function it returns waits for that work and writes the payload (once,
  // on any thread). Partitions may be in flight together; the next step's
  // StartEncode of a partition comes after FinishApplies. The host engine
  // does the whole Encode in the returned function.
  using PendingEncode = std::function<absl::Status(std::string* payload)>;
  // `hyper` is copied: it need not outlive the call.
  virtual absl::StatusOr<PendingEncode> StartEncode(
      int64_t step, uint32_t rank, const compress::Partition& p,
      float grad_scale = 1.0f, const compress::StepHyper* hyper = nullptr);
  // Applies the reply of partition `p` for `step` (compress::PlanReply, with
  // the step's `hyper` when the workers set one, and the averaged
  // gradient's clip factor `grad_scale`); INVALID_ARGUMENT, nothing
  // changed, for a malformed reply. `piece_stats` (an optimizer with a
  // layer rule, may be empty): the layer statistics of the partition's
  // pieces at this step as its shard took them on its mirror
  // (compress::PieceStats; PushReply `piece_stats`), which an engine may
  // use instead of its own.
  // `clip_pieces` (a clip of part of the model, grad_scale 1): the
  // partition's pieces (compress::ClipPiecesOf), each scaling its decoded
  // values before the update.
  virtual absl::Status ApplyReply(
      int64_t step, const compress::Partition& p,
      absl::Span<const uint8_t> reply,
      const compress::StepHyper* hyper = nullptr, float grad_scale = 1.0f,
      absl::Span<const double> piece_stats = {},
      absl::Span<const compress::ClipPiece> clip_pieces = {}) = 0;
  // Applies partition `p`'s part of the gradient the workers amended step
  // `step` to (Session::AmendAt: `gradient`, its p.range.size() floats),
  // in place of the decoded reply and its clip (and of a reply staged for
  // `p`, which is dropped), as every replica and mirror does (design.md
  // 2.6, "Edits after the clip").
  virtual absl::Status ApplyAmended(int64_t step, const compress::Partition& p,
                                    absl::Span<const float> gradient,
                                    const compress::StepHyper* hyper) = 0;
  // A reply kept for the end of the step (Session::SetDeferApply) taken
  // ahead into the engine's own memory as it lands (a GPU engine copies it
  // to the device; x, m and v unchanged), then applied by ApplyStagedReply
  // with what ApplyReply takes. INVALID_ARGUMENT for a malformed reply;
  // UNIMPLEMENTED where the engine keeps no replies (the host's: the
  // session keeps the bytes and calls ApplyReply).
  virtual absl::Status StageReply(int64_t, const compress::Partition&,
                                  absl::Span<const uint8_t>) {
    return absl::UnimplementedError("replies are applied from the host");
  }
  virtual absl::Status ApplyStagedReply(
      int64_t, const compress::Partition&, const compress::StepHyper* = nullptr,
      float = 1.0f,
      absl::Span<const compress::ClipPiece> /*clip_pieces*/ = {}) {
    return absl::UnimplementedError("replies are applied from the host");
  }
  // The bytes of the reply StageReply took for `p` and nothing has applied
  // yet, where the engine keeps them on the host (a GPU engine's pinned
  // staging, valid until the reply is applied): what Session::
  // AverageGradient decodes. FAILED_PRECONDITION where none is staged;
  // UNIMPLEMENTED where the engine keeps no replies.
  virtual absl::StatusOr<absl::Span<const uint8_t>> StagedReply(
      const compress::Partition&) const {
    return absl::UnimplementedError("replies are applied from the host");
  }
  // The session begins the exchange of `step` (each attempt at it): what
  // the engine kept of an earlier attempt's replies no longer counts.
  virtual void BeginReplies(int64_t /*step*/) {}
  // Returns once every reply applied so far has changed the parameters (a
  // GPU engine's ApplyReply only enqueues its work); the session calls it
  // at the end of each step, before anything reads x.
  virtual absl::Status FinishApplies() { return absl::OkStatus(); }
  // zero_one_adam's local step of `step` from the whole gradient
  // (compress::Replica::LocalStep; before a sync step's Encode), with the
  // step's `hypers` as Session::SetStepHyper took them (none, one, or one
  // per segment). Returns the learning rates of the interval's local steps
  // so far, summed, one per segment (what a sync's pushes carry as their
  // lr when the workers set the lr). `pool` as for CommitStep.
  virtual absl::StatusOr<std::vector<float>> LocalStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      float grad_scale, compress::ComputePool* pool) = 0;
  // A sync step's local step run partition by partition inside Encode
  // (compress::Replica::BeginSyncLocalStep), instead of LocalStep before the
  // first push; returns what LocalStep would. UNIMPLEMENTED where the engine
  // does not (then LocalStep); other errors change nothing.
  virtual absl::StatusOr<std::vector<float>> BeginSyncLocalStep(
      int64_t, absl::Span<const compress::StepHyper>) {
    return absl::UnimplementedError("a local step by partition");
  }
  // The optimizer's step after every reply of `step` is applied, for an
  // optimizer that commits (its layer rule, compress::Optimizer::Layers):
  // its commit from the whole model, applied to x, returned for the shards
  // (compress::Replica::CommitStep). `hypers`: the step's, as
  // Session::SetStepHyper took them (none, one, or one per segment).
  // `pool` (may be null): the worker's compute pool, idle by then, for a
  // CPU engine's whole-model passes.
  virtual absl::StatusOr<std::vector<double>> CommitStep(
      int64_t step, absl::Span<const compress::StepHyper> hypers,
      compress::ComputePool* pool) = 0;
  // compress::GradientSumOfSquares of the whole gradient the next Encode
  // reads (gradient clipping); FAILED_PRECONDITION where the engine cannot.
  virtual absl::StatusOr<double> GradientSumOfSquares() = 0;

 protected:
  // The engine's parameters and gradient arrays (dim floats), for the
  // gradient hook.
  virtual float* x() = 0;
  virtual float* grad() = 0;
  virtual uint64_t x_dim() const = 0;

 private:
  std::unique_ptr<GradientHook> hook_;
};

// The state an engine works on: the job's algorithm and layout, and the
// session's host replica and error buffer (the host engine's own state; a
// GPU engine's copy source and destination).
struct EngineState {
  const compress::AlgorithmConfig* config = nullptr;
  const compress::Layout* layout = nullptr;
  compress::Replica* replica = nullptr;
  compress::ErrorFeedback* error = nullptr;
};

// The engine named `kind`: "cpu", or "cuda" (FAILED_PRECONDITION, with the
// reason, when there is no GPU or this build has no CUDA; UNIMPLEMENTED for
// settings the GPU lacks: topk, int8-stored error buffers). `arrays` only
// for "cuda".
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const std::string& kind,
                                                     const EngineState& state,
                                                     DeviceArrays arrays = {});
// The GPU a "cuda" engine would use, or why there is none.
absl::StatusOr<std::string> DescribeCuda();

}  // namespace morse::worker

#endif  // MORSE_WORKER_ENGINE_ENGINE_H_
