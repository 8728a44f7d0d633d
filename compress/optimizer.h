// The optimizer seam: each algorithm Morse trains with is one class in
// compress/optimizers/, and everything that differs between optimizers is
// asked of it here, never decided by a branch on OptimizerKind elsewhere.
//
// An optimizer says what each step does (its plan: codecs, compression,
// local steps, exchanges), how a reply becomes an update (its part of the
// reply rule), which settings of AlgorithmConfig are its own (validation,
// fingerprint), which state it keeps beyond x, m, v and the error buffers
// (named arrays, as checkpoints name them), and what the workers commit to
// the shards after a step (its layer rule, compress/layers.h). The element
// loops it names live in update_rules, lamb and the kernel tables, written
// once for every replica. design.md 5 ("The optimizer seam") says how to add
// one, step by step.
#ifndef MORSE_COMPRESS_OPTIMIZER_H_
#define MORSE_COMPRESS_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/fnv.h"
#include "compress/layers.h"
#include "compress/step_rules.h"

namespace morse::compress {

// A state array an optimizer keeps beyond x, m, v and the error buffers,
// on every replica (workers and the shards' mirrors). Its name is the key
// of checkpoints and state dicts.
struct StateArray {
  std::string name;
  // One float per element of the replica's range (v'), or `floats` floats
  // whatever the range (per-layer state).
  bool per_element = true;
  uint64_t floats = 0;  // when not per element
};

// A state array's values, as checkpoints, FetchPartition and
// RestorePartition carry them.
struct NamedState {
  std::string name;
  std::vector<float> values;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // JobConfig's `optimizer` value ("onebit_adam", "adam", ...).
  virtual absl::string_view name() const = 0;
  virtual OptimizerKind kind() const = 0;

  // OK or INVALID_ARGUMENT naming the field: this optimizer's own settings
  // in `config`; ValidateAlgorithmConfig has checked the common ones.
  virtual absl::Status Validate(const AlgorithmConfig& /*config*/) const {
    return absl::OkStatus();
  }
  // Mixes its own settings into AlgorithmFingerprint (none by default).
  virtual void Fingerprint(const AlgorithmConfig& /*config*/,
                           Fnv64& /*hash*/) const {}

  // What step `step` (0-based) does.
  virtual StepPlan Plan(const AlgorithmConfig& config, int64_t step) const = 0;
  // A plan of its in words, for logs, traces and errors ("warmup", ...).
  virtual const char* Phase(const StepPlan& plan) const = 0;
  // The first step >= `step` at which the workers push.
  virtual int64_t NextExchange(const AlgorithmConfig& /*config*/,
                               int64_t step) const {
    return step;
  }
  // Whether the partition starting at `first_index` sits step `step` out
  // (streaming diloco's fragments not due): its pushes and reply are empty
  // and nothing of it changes anywhere (design.md 2.11).
  virtual bool Idle(const AlgorithmConfig& /*config*/, int64_t /*step*/,
                    uint64_t /*first_index*/) const {
    return false;
  }
  // Completes a sender's rule of a step (PlanSend has set the codec, the
  // local momentum and its beta1, `accumulated` for a local plan's push,
  // feedback, the mask, the rounding key and `idle`): zero_one_adam's sync
  // scalars.
  virtual void PlanSend(const AlgorithmConfig& /*config*/, int64_t /*step*/,
                        const StepPlan& /*plan*/, const StepHyper* /*hyper*/,
                        SendRule& /*rule*/) const {}
  // Completes the reply rule of a step that exchanges: PlanReply has set
  // the codec, the masks, the clip factor and Adam's scalars at the step's
  // learning rate and weight decay with t' = step + 1.
  virtual void PlanReply(const AlgorithmConfig& /*config*/, int64_t /*step*/,
                         const StepPlan& /*plan*/, const StepHyper* /*hyper*/,
                         ReplyRule& /*rule*/) const {}

  // Whether the job's freeze_step is this optimizer's (the last warmup step
  // is freeze_step - 1, so it is at least 1).
  virtual bool HasFreezeStep() const { return false; }
  // Whether some steps update with a frozen v, so that mask_zero_variance
  // and bound_update mean something.
  virtual bool FreezesVariance() const { return true; }

  // The inner steps each worker takes per job step with an optimizer of its
  // own, whose result it pushes (diloco's sync_every / fragments, after any
  // warmup: InnerStepsBefore, optimizers/diloco.h); 0: none, a step's push
  // is its gradient.
  virtual int64_t InnerSteps(const AlgorithmConfig& /*config*/) const {
    return 0;
  }

  // Whether a step's lr and weight_decay may differ from partition to
  // partition (parameter groups: the layout's segments, each push carrying
  // its own): only where every use of them is a partition's reply rule or
  // can take each segment's (onebit_lamb's commit, per layer; zero_one_adam's
  // local steps and lr sums, per segment), not one value for the whole model
  // (diloco's outer step).
  virtual bool HyperByPartition() const { return false; }
  // Whether a step's pushes may carry betas and eps of their own (StepHyper
  // moments: a scheduler that cycles the momentum, groups with their own),
  // which every use of them then takes: only where each use is the
  // partition's reply rule, PlanSend's rule or LocalStepScalars, all of
  // which read StepAdamHyper (CheckStepHyper refuses them elsewhere).
  virtual bool FollowsStepMoments() const { return false; }
  // Whether a step's pushes may say from which step a segment's parameters
  // train (StepHyper::first_step, a group added mid-job), each use of the
  // step count then counting from there: only where that use is a bias
  // correction (StepScalars', FrozenVarianceScalars', zero_one_adam's n_v;
  // adam, onebit_adam, onebit_lamb, whose layers' averages start from their
  // initial state at that step, and zero_one_adam, whose schedules stay the
  // job's); elsewhere state that counts steps (diloco's inner steps) would
  // need its own.
  virtual bool CountsFromFirstStep() const { return false; }
  // The step from which a segment whose parameters train since
  // `first_step` (> 0) counts its updates: `first_step` itself, or a later
  // one where the optimizer holds the segment until then (zero_one_adam:
  // its first variance step, the 1-bit steps before it masking the whole
  // segment, whose v is 0). INVALID_ARGUMENT where it cannot train from
  // there (its variance would freeze before it had any).
  virtual absl::StatusOr<int64_t> FirstCountedStep(
      const AlgorithmConfig& config, int64_t first_step) const;

  // Whether the CUDA engine implements its reply rule (else a GPU worker
  // refuses the job, and --device auto trains on the CPU, saying why).
  virtual bool HasGpuKernels() const { return true; }

  // Its state beyond x, m, v and the error buffers.
  virtual std::vector<StateArray> State(
      const AlgorithmConfig& /*config*/) const {
    return {};
  }
  // The arrays of a local interval in progress, where workers step on
  // their own between exchanges (zero_one_adam's local phase: x at the
  // interval's start, the update accumulated since, each segment's
  // learning-rate sum): a worker's alone, kept by its checkpoints and its
  // engine, never sent to the shards. A per-element one may be held empty
  // (no interval under way). None: the workers take no local steps.
  virtual std::vector<StateArray> IntervalState(
      const AlgorithmConfig& /*config*/) const {
    return {};
  }
  // The starting values of one of its arrays that is not per element (per
  // element arrays start at +0).
  virtual std::vector<float> InitialState(const AlgorithmConfig& /*config*/,
                                          const StateArray& array) const {
    return std::vector<float>(array.floats, 0.0f);
  }
  // Its arrays that are not per element, in State()'s order, after the step
  // whose commit is `commit` (CommitDoubles values, validated): what a
  // shard's partition keeps once it has applied the commit.
  virtual std::vector<std::vector<float>> StateAfterCommit(
      const AlgorithmConfig& /*config*/,
      absl::Span<const double> /*commit*/) const {
    return {};
  }
  // OK or INVALID_ARGUMENT: values of its arrays (every one of State(), in
  // order and sized) that no replica could hold, from a peer or a saved run;
  // `what` starts the message ("the saved state of partition 3").
  virtual absl::Status ValidateState(absl::Span<const NamedState> /*state*/,
                                     absl::string_view /*what*/) const {
    return absl::OkStatus();
  }

  // Its rule over whole layers (compress/layers.h: onebit_lamb's trust
  // ratios), or nullptr: its steps move x by the replies alone. With one,
  // the workers commit each step's layer values to the shards (CommitDoubles
  // of them), and its state holds one per-element array (read as the rule's
  // `fresh`) and one layer state array, in that order.
  virtual const LayerRule* Layers() const { return nullptr; }

  // OK or INVALID_ARGUMENT: a commit of CommitDoubles values that no
  // worker could send (from a peer or a saved run): the layer rule's
  // (ValidateCommitOfLayers).
  absl::Status ValidateCommit(const AlgorithmConfig& config,
                              absl::Span<const double> commit) const;

  // How many doubles the workers commit to the shards after each step,
  // before the shards' mirrors can move x: the layer rule's values for
  // every layer, or 0 (the commit then holds the clip's norm only, when
  // the step clips the average).
  uint64_t CommitDoubles(const AlgorithmConfig& config) const;
};

// The optimizer of `config` (config.optimizer).
const Optimizer& OptimizerOf(const AlgorithmConfig& config);
const Optimizer& OptimizerOf(OptimizerKind kind);
// The optimizer JobConfig calls `name`, or nullptr.
const Optimizer* FindOptimizer(absl::string_view name);
// Every optimizer's name, for errors: "onebit_adam, adam, zero_one_adam,
// onebit_lamb or diloco".
std::string OptimizerNames();

// The job's algorithm as a whole, the optimizer's part included (these ask
// it, so they live here rather than in compress/algorithm.h):
// OK or INVALID_ARGUMENT naming the field; shared with the job config loader.
absl::Status ValidateAlgorithmConfig(const AlgorithmConfig& config);
// INVALID_ARGUMENT when `hyper` is malformed (ValidateStepHyper, checked
// first), sets betas and eps for an optimizer that applies the job's
// (Optimizer::FollowsStepMoments: diloco), or starts a segment mid-job where
// the optimizer cannot (Optimizer::CountsFromFirstStep, freeze_step).
absl::Status CheckStepHyper(const AlgorithmConfig& config,
                            const StepHyper& hyper);
// A fingerprint of everything in `config` that must not change when a job
// resumes from a checkpoint: workers, layout, optimizer, Adam
// hyper-parameters, freeze step, codecs, feedback and seed, and the
// optimizer's own settings (Optimizer::Fingerprint). The learning-rate
// schedule is left out, so a resumed job may train for more steps.
uint64_t AlgorithmFingerprint(const AlgorithmConfig& config);

// Whether the workers commit values after every step (the optimizer has a
// layer rule: onebit_lamb's layer coefficients).
bool CommitsLayers(const AlgorithmConfig& config);
// Whether the workers take local steps (Optimizer::IntervalState is not
// empty).
bool StepsLocally(const AlgorithmConfig& config);

// OK or INVALID_ARGUMENT: `state` holds every array of the optimizer's
// State(), in order, each of its length (`elements` for per-element
// arrays), with values it accepts (ValidateState); `what` starts the
// message.
absl::Status CheckState(const AlgorithmConfig& config, uint64_t elements,
                        absl::Span<const NamedState> state,
                        absl::string_view what);

// OK or INVALID_ARGUMENT: `interval` holds every array of the optimizer's
// IntervalState(), in order, the per-element ones all `elements` long or
// all empty, the others of their length; `what` starts the message.
absl::Status CheckInterval(const AlgorithmConfig& config, uint64_t elements,
                           absl::Span<const NamedState> interval,
                           absl::string_view what);

// The state arrays' bytes per element of a replica (4 per per-element
// array).
uint64_t StateBytesPerElement(const AlgorithmConfig& config);

// For the optimizers' PlanReply: the frozen-variance phase's corrections
// and bound (1-bit Adam's compression phase, DESIGN 2.1): v̂ = v/(1 -
// b2^T_w) with bias correction (T_w = freeze_step - `hyper`'s first_step:
// the updates the segment's v had), and |update| <= OneBitUpdateBound when
// bound_update is on.
// The step's betas and eps (`hyper`'s where it sets them) govern both.
void FrozenVarianceScalars(const AlgorithmConfig& config,
                           const StepHyper* hyper, ReplyRule& rule);
// The job's adam section with the step's betas and eps where `hyper` sets
// them (CheckStepHyper: Optimizer::FollowsStepMoments).
AdamHyper StepAdamHyper(const AlgorithmConfig& config, const StepHyper* hyper);
// Adam's scalars of step `step` (t' = step + 1, less `hyper`'s first_step)
// at the workers' lr and weight decay (`hyper`) or the job's schedule and
// weight decay.
AdamScalars StepScalars(const AlgorithmConfig& config, int64_t step,
                        const StepHyper* hyper, bool bias_correction);
// The two kinds of step every optimizer's schedule is made of: full
// precision in warmup_codec both ways without error feedback, or
// compressed (frozen v) in the up and down codecs through error feedback.
StepPlan FullPrecisionPlan(const AlgorithmConfig& config);
StepPlan CompressedPlan(const AlgorithmConfig& config);
// adam's and diloco's every step: the up and down codecs through error
// feedback, with a v that is never frozen.
StepPlan UnfrozenPlan(const AlgorithmConfig& config);
// OK or INVALID_ARGUMENT unless warmup_codec is fp32, fp16 or bf16; `what`
// names what uses it ("the warmup codec of onebit_adam").
absl::Status ValidateWarmupCodec(const AlgorithmConfig& config,
                                 absl::string_view what);
// 1-bit Adam's schedule, which 1-bit LAMB shares: warmup_codec without
// error feedback before freeze_step, the up and down codecs with it from
// then on (compressing). ValidateFreezeStep checks what it needs: a warmup
// codec of fp32, fp16 or bf16 and freeze_step >= 1; `name` is the
// optimizer's.
StepPlan FreezeStepPlan(const AlgorithmConfig& config, int64_t step);
absl::Status ValidateFreezeStep(const AlgorithmConfig& config,
                                absl::string_view name);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_OPTIMIZER_H_
