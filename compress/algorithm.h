// The algorithm of a job: the optimizer, its hyper-parameters, codecs,
// error feedback, layout and schedule (AlgorithmConfig), which every worker,
// shard, mirror and the simulator run by; JobConfig (proto/job_config.h)
// loads it. What each optimizer does with it, and the checks and the
// fingerprint of the whole (which ask the optimizer): compress/optimizer.h.
#ifndef MORSE_COMPRESS_ALGORITHM_H_
#define MORSE_COMPRESS_ALGORITHM_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/layout.h"
#include "compress/update_rules.h"

namespace morse::compress {

// A step's betas and eps set by the workers instead of the job's adam
// section (PyTorch's param_groups under a scheduler that cycles the
// momentum, as OneCycleLR does): every optimizer but `diloco`
// (CheckStepHyper), whose updates take them, bias corrections included,
// from their scalars (the local momentum, frozen-variance correction and
// bound too: design.md 2.1; zero_one_adam's v correction, local steps and
// sync message: 2.7; onebit_lamb's fresh variance and layer sums: 2.8).
struct StepMoments {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
};

// A step's learning rate and weight decay set by the workers (PyTorch's
// param_groups, carried in every push) instead of the job's schedule and
// adam.weight_decay, and its betas and eps where they set those too. lr
// and weight_decay finite and not negative, the moments as the job's
// adam section, first_step not negative (ValidateStepHyper).
struct StepHyper {
  StepHyper() = default;
  StepHyper(float lr, float weight_decay,
            std::optional<StepMoments> moments = std::nullopt,
            int64_t first_step = 0)
      : lr(lr),
        weight_decay(weight_decay),
        moments(moments),
        first_step(first_step) {}

  float lr = 0;
  float weight_decay = 0;
  std::optional<StepMoments> moments;
  // The job step at which the segment's parameters began to train, from
  // which its bias corrections count Adam's updates (t = step + 1 -
  // first_step, torch's per-parameter step; the frozen variance's 1 -
  // b2^(freeze_step - first_step)): a group that morse.torch's
  // add_param_group added at that step. 0 for the rest. Only where the
  // optimizer counts them so (Optimizer::CountsFromFirstStep) and, with a
  // freeze step, before it (CheckStepHyper); never after the step it is
  // used in (the shard checks each push).
  int64_t first_step = 0;
};
absl::Status ValidateStepHyper(const StepHyper& hyper);
// The same bits (what every worker's push of a partition and step must
// carry), and in words for messages.
bool SameStepHyper(const std::optional<StepHyper>& a,
                   const std::optional<StepHyper>& b);
std::string DescribeStepHyper(const std::optional<StepHyper>& hyper);

enum class OptimizerKind : uint8_t {
  kOneBitAdam,
  kAdam,
  kZeroOneAdam,
  kOneBitLamb,
  kDiloco
};

// zero_one_adam's schedule (design.md 2.7; DeepSpeed's ZeroOneAdam names and
// defaults). Steps are counted from 1 here, as in the paper: step t of the
// job is s = t + 1.
struct ZeroOneSpec {
  // F: v may be updated at steps s <= F only; from s = F + 1 on the local
  // phase (local steps and syncs). At least 1.
  int64_t var_freeze_step = 100000;
  // kappa: v is updated at kappa steps with interval 1, then kappa with
  // interval 2, 4, ... At least 1.
  int64_t var_update_scaler = 16;
  // The local phase's interval between syncs doubles every this many steps
  // (S, at least 1) up to local_step_clipper (H, at least 1).
  int64_t local_step_scaler = 32678;
  int64_t local_step_clipper = 16;
};

// onebit_lamb's coefficients (design.md 2.8; DeepSpeed's OnebitLamb names
// and defaults). Warmup: a layer's coefficient is ||x|| / ||u|| clamped to
// [min_coeff, max_coeff], and coeff_freeze its moving average with
// coeff_beta. Compression: coeff_freeze times a factor from the fresh
// variance, clamped to [factor_min, factor_max] and to within
// factor_threshold of the last step's.
struct LambSpec {
  float max_coeff = 10.0f;
  float min_coeff = 0.01f;
  float coeff_beta = 0.9f;
  float factor_max = 4.0f;
  float factor_min = 0.5f;
  float factor_threshold = 0.1f;
};

// diloco's outer optimizer (design.md 2.11; the DiLoCo paper's names and
// defaults). Each worker runs sync_every inner steps of its own optimizer,
// then pushes its pseudo-gradient x_outer - x_local; every replica applies
// SGD with (Nesterov) momentum to the average: m = mu*m + d; x -= lr *
// (nesterov ? d + mu*m : m).
struct DilocoSpec {
  int64_t sync_every = 500;     // H: inner steps per outer step, at least 1
  float outer_lr = 0.7f;        // positive and finite
  float outer_momentum = 0.9f;  // in [0, 1)
  bool nesterov = true;
  // Streaming DiLoCo (Douillard et al. 2025): F fragments, partition q in
  // fragment q mod F; step t syncs fragment t mod F alone, every
  // sync_every / F inner steps (F divides sync_every and the partitions).
  int64_t fragments = 1;
  // Overlap (Streaming DiLoCo's tau): a worker applies outer step t's reply
  // overlap_steps inner steps into step t + 1, the exchange running
  // meanwhile, in [0, sync_every / fragments). A synced partition's own
  // parameters then become mixing * local + (1 - mixing) * outer
  // (MergeOuter, compress/optimizers/diloco.h); mixing in [0, 1).
  int64_t overlap_steps = 0;
  float mixing = 0.0f;
  // A synchronous warmup: the first warmup_steps outer steps come after
  // warmup_sync_every inner steps each (1: every inner step syncs, close to
  // synchronous training while the model moves fastest), the later ones
  // after sync_every / fragments (InnerStepsBefore, diloco.h). 0: none.
  int64_t warmup_steps = 0;
  int64_t warmup_sync_every = 1;  // at least 1; above overlap_steps
};

// A onebit_lamb layer's state, the same on every replica (compress/lamb.h).
struct LambLayerState {
  float coeff_freeze = 0.0f;  // the warmup coefficients' moving average
  float last_factor = 1.0f;   // the compression phase's last factor
};

struct AlgorithmConfig {
  OptimizerKind optimizer = OptimizerKind::kOneBitAdam;
  uint32_t workers = 1;  // N
  LayoutSpec layout;
  AdamHyper adam;
  LrSchedule lr;
  // onebit_adam: steps t < freeze_step are warmup (full-precision Adam);
  // from freeze_step on, v is frozen. At least 1.
  int64_t freeze_step = 1;
  // onebit_adam: the codec of both directions in warmup (fp32, fp16, bf16;
  // no error feedback).
  CodecSpec warmup_codec{CodecKind::kFp32};
  // The compression-phase codecs (onebit_adam) or the every-step codecs
  // (adam): up = worker -> server, down = server -> worker.
  CodecSpec up_codec{CodecKind::kSign1};
  CodecSpec down_codec{CodecKind::kSign1};
  FeedbackSpec worker_feedback;  // ef by default
  FeedbackSpec server_feedback;
  // Both optimizers (DESIGN 2.1, 2.2): m̂ = m/(1-b1^t'), v̂ = v/(1-b2^t'),
  // and for onebit_adam v̂ = v/(1-b2^T_w) from the freeze on. Off: m̂ = m,
  // v̂ = v (DeepSpeed's OnebitAdam).
  bool bias_correction = true;
  // onebit_adam (DESIGN 2.1): from the freeze on, elements whose frozen v
  // is exactly 0 send, carry and apply +0.
  bool mask_zero_variance = true;
  // onebit_adam (DESIGN 2.1): from the freeze on, |m̂/(sqrt(v̂)+eps)| is at
  // most OneBitUpdateBound(adam), Adam's own largest step.
  bool bound_update = true;
  // Clipping by the gradient's global L2 norm (torch's clip_grad_norm_),
  // 0: off. Steps that average gradients (adam, onebit_adam's warmup) scale
  // the averaged gradient by ClipScale of its norm over the whole model;
  // onebit_adam's compression phase, which has no averaged gradient, scales
  // each worker's own gradient by ClipScale of its own norm before its local
  // momentum (as DeepSpeed does). ClipsAverage/ClipsLocally say which.
  float clip_grad_norm = 0;
  ZeroOneSpec zero_one;  // zero_one_adam only
  LambSpec lamb;         // onebit_lamb only
  DilocoSpec diloco;     // diloco only
  // The model's layers (parameter tensors) as element counts in order,
  // summing to layout.dim; empty: one layer of the whole model. Only
  // onebit_lamb reads them (its coefficients are per layer).
  std::vector<uint64_t> layers;
  uint64_t seed = 0;  // stochastic rounding
};

// OK or INVALID_ARGUMENT naming the field: the checks every optimizer
// shares (workers, layout, Adam's settings, schedule, codecs, freeze_step,
// layers, feedback, clipping). ValidateAlgorithmConfig
// (compress/optimizer.h) adds the optimizer's own.
absl::Status ValidateCommonAlgorithm(const AlgorithmConfig& config);
// INVALID_ARGUMENT when step `step` would use `hyper` before its segment's
// first step (what every replica checks where the step is known).
absl::Status CheckHyperAtStep(const StepHyper& hyper, int64_t step);

// The stochastic-rounding key of a sender: workers are ranks 0..N-1, shard s
// sends as rank N + s.
RoundingKey SenderKey(const AlgorithmConfig& config, int64_t step,
                      uint32_t sender_rank, uint64_t first_index);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_ALGORITHM_H_
