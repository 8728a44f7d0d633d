// Replica: x, m and v over one range of the flat parameter vector, and the
// one place that turns a shard's reply into an update (DESIGN 2.1-2.2). A
// worker holds a replica of [0, D); a server shard mirrors its own range.
// Both run this same code on the same bytes, which is what keeps them
// bit-identical (DESIGN 2.5).
//
// ApplyReply on disjoint partitions may run concurrently; everything else is
// thread-compatible.
#ifndef MORSE_COMPRESS_REPLICA_H_
#define MORSE_COMPRESS_REPLICA_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/algorithm.h"
#include "compress/clipping.h"
#include "compress/error_feedback.h"
#include "compress/halving_sum.h"
#include "compress/layers.h"
#include "compress/layout.h"
#include "compress/optimizer.h"
#include "compress/optimizers/zero_one_adam.h"
#include "compress/step_plan.h"

namespace morse::compress {

class ComputePool;

// The update of a ReplyRule on host arrays of decoded.size() elements
// (decoded is scratch: it may be masked in place). `anchor`: x at the last
// sync for a sync rule (empty: x itself, a shard's mirror).
void ApplyRule(const ReplyRule& rule, absl::Span<float> decoded,
               absl::Span<float> x, absl::Span<float> m, absl::Span<float> v,
               absl::Span<const float> anchor = {},
               absl::Span<float> v_fresh = {});
// The zero-variance mask as a selection: values[j] = +0 where v[j] == 0.
void SelectByVariance(absl::Span<const float> v, absl::Span<float> values);

// A 64-bit checksum of float arrays' bits, in order (FNV-1a over 8-byte
// words, then the tail). For comparing replicas, never for security.
uint64_t StateChecksum(std::initializer_list<absl::Span<const float>> arrays);

class Replica {
 public:
  // Zero x, m, v over `range`.
  Replica(const AlgorithmConfig& config, Range range);
  // x lives in memory the caller owns (range.size() floats, kept alive and
  // not resized while the replica exists), such as a PyTorch flat tensor.
  Replica(const AlgorithmConfig& config, Range range,
          absl::Span<float> external_x);
  Replica(const Replica&) = delete;  // x may point into this object
  Replica& operator=(const Replica&) = delete;
  Replica(Replica&&) = default;

  const Range& range() const { return range_; }
  absl::Span<float> x() { return x_; }
  absl::Span<float> mutable_m() { return absl::MakeSpan(m_); }
  // Forgets what VarianceMask knew of v: the caller is about to write it
  // (a restore), and no VarianceMask over the elements it writes runs
  // beside it.
  absl::Span<float> mutable_v() {
    zeros_->generation.fetch_add(1, std::memory_order_relaxed);
    return absl::MakeSpan(v_);
  }
  absl::Span<const float> x() const { return x_; }
  absl::Span<const float> m() const { return m_; }
  absl::Span<const float> v() const { return v_; }

  // The zero-variance mask's v over global elements [begin, begin + n):
  // v there, or an empty span where none of it is exactly 0, so that an
  // encode with the mask (EncodeWorkerMessage, EncodeShardReply) skips
  // reading v, 4 bytes an element; the mask changes only elements whose v
  // is 0, so its bits are the same either way. Whether each block of v
  // (the layout's block_elems) holds a 0 is found once and kept until v
  // changes there (ApplyReply with a rule that writes v, mutable_v): in
  // the compression phase, where v is frozen, once a run. Safe beside
  // calls over other partitions (partitions are whole blocks).
  absl::Span<const float> VarianceMask(uint64_t begin, uint64_t n) const;

  // Decodes the reply of step `step` for global elements [begin, begin + n)
  // (with the workers' `hyper`, if they set one)
  // and applies the update. INVALID_ARGUMENT (nothing changed) if the
  // payload is malformed or the range is outside the replica.
  // `grad_scale`: the step's clip factor (ClipScale), when it clips.
  // `segment_stats` (an optimizer with a layer rule, a partition's range):
  // also sets it to what SegmentStats gives after the update, each segment
  // computed as
  // soon as the piece of the reply that holds it is applied, while its
  // elements are still in cache (the same bits: one pass instead of two).
  // `clip_pieces` (a clip of part of the model, relative to `begin`, as
  // ClipPiecesOf gives them; grad_scale is then 1): the decoded values
  // scaled by their pieces' factors before the update.
  // `amended`: the payload is the gradient the workers amended the step to
  // (design.md 2.6, "Edits after the clip"), fp32 whatever the step's
  // codec, which every replica applies as it is.
  absl::Status ApplyReply(int64_t step, uint64_t begin, uint64_t n,
                          absl::Span<const uint8_t> reply,
                          const StepHyper* hyper = nullptr,
                          float grad_scale = 1.0f,
                          std::vector<double>* segment_stats = nullptr,
                          absl::Span<const ClipPiece> clip_pieces = {},
                          bool amended = false);

  // The local momentum m_i = b1*m + (1-b1)*g of [begin, begin + g.size()),
  // with g scaled by `grad_scale` first (ClipsLocally) unless it is 1; b1
  // is the step's (SendRule::beta1: the job's, or the workers' for the
  // partition).
  void LocalMomentum(float beta1, uint64_t begin, absl::Span<const float> g,
                     absl::Span<float> out, float grad_scale = 1.0f) const;

  // zero_one_adam's local phase (design.md 2.7), on a worker's whole
  // replica: the local step of `step` from gradient g (scaled by
  // grad_scale), which moves x only when the step does not sync. `hypers`:
  // the step's learning rates and weight decays as the workers set them
  // (HyperOf: none, one, or one per segment; each segment steps with its
  // own). FAILED_PRECONDITION outside the local phase, or in the middle of
  // an interval this replica did not start (state from a sync is needed);
  // INVALID_ARGUMENT for another count of hypers. Nothing changes on error.
  // `pool` (may be null) runs the element loop over chunks in parallel.
  absl::Status LocalStep(int64_t step, absl::Span<const float> g,
                         absl::Span<const StepHyper> hypers = {},
                         float grad_scale = 1.0f, ComputePool* pool = nullptr);
  // The local step of a sync step, run a range at a time (a CPU worker's
  // encode of each partition, which then overlaps the gradient and the
  // other pushes, as 1-bit Adam's momentum does): BeginSyncLocalStep does
  // LocalStep's bookkeeping, after which lr_sums() holds the interval's
  // sums with this step's; LocalStepRange then runs the element loop over
  // one range of the gradient, each range once, before its SyncMessage.
  // The same values as LocalStep. BeginSyncLocalStep changes nothing on
  // error: as LocalStep, or FAILED_PRECONDITION for a step that does not
  // sync.
  absl::Status BeginSyncLocalStep(int64_t step,
                                  absl::Span<const StepHyper> hypers = {});
  bool local_step_by_range(int64_t step) const {
    return by_range_.step == step;
  }
  // With `sync` (the rule's scalars SyncMessage takes), the range's sync
  // message goes into `message` (g.size() floats) in the same pass: the
  // values of SyncMessage after it, without reading u and v again.
  absl::Status LocalStepRange(int64_t step, uint64_t begin,
                              absl::Span<const float> g,
                              const AdamScalars* sync = nullptr,
                              absl::Span<float> message = {});
  // The sync message of [begin, begin + out.size()) at sync step `step`
  // (ZeroOneSyncMessage with `s`, the rule's LocalStepScalars at the
  // partition's betas and eps, each segment's elements with its own sum),
  // after LocalStep of that step.
  void SyncMessage(int64_t step, const AdamScalars& s, uint64_t begin,
                   absl::Span<float> out) const;
  // The learning rates of this interval's local steps so far, summed, one
  // per segment of the layout (equal without groups of their own): what a
  // sync's pushes of each segment carry as their lr when the workers set
  // the lr.
  absl::Span<const float> lr_sums() const { return lr_sums_; }
  // The local interval in progress (Optimizer::IntervalState, in its
  // order), for a worker's checkpoint and engine: x at its start
  // (`anchor`), the update accumulated since (`u`), and each segment's
  // learning-rate sum (`lr_sum`); anchor and u empty before the local phase
  // and for an interval of one step, which leaves x alone until its sync.
  // The one place that maps the interval's names to this replica's storage.
  std::vector<NamedState> SaveInterval() const;
  // The last step LocalStep ran (-1: none).
  int64_t last_local_step() const { return local_step_; }
  // Sets SaveInterval's form back, with the interval's last local step:
  // INVALID_ARGUMENT, nothing changed, unless CheckInterval accepts it.
  absl::Status RestoreInterval(absl::Span<const NamedState> interval,
                               int64_t last_step);

  // An optimizer with a layer rule (compress/layers.h: onebit_lamb):
  // ApplyReply moves m, v and its per-element array; x follows the step's
  // commit. A worker, holding the whole model, forms the commit itself once
  // every reply of `step` is applied, applies it, and returns it for the
  // shards; FAILED_PRECONDITION for a replica of part of the model or an
  // optimizer without one. `hypers`: the step's learning rates and weight
  // decays as the workers set them (HyperOf: none, one, or one per segment;
  // INVALID_ARGUMENT, nothing changed, for another count).
  //
  // `partition_stats`, if not empty, holds per partition (by id) the
  // statistics of its pieces at this step (PieceStats of its SegmentStats),
  // or nothing for those to compute here: a worker takes them from each
  // reply (its shard's, PushReply `piece_stats`) or computes them as each
  // reply lands, instead of in one pass after the last.
  // `pool` (may be null) moves x over the partitions in parallel.
  //
  // `moved` (empty, or one flag per layer): the layers MoveLayer has moved
  // already at this step, whose x CommitStep leaves alone (their commit is
  // the same either way).
  absl::StatusOr<std::vector<double>> CommitStep(
      int64_t step, absl::Span<const StepHyper> hypers = {},
      absl::Span<const std::vector<double>> partition_stats = {},
      ComputePool* pool = nullptr, const std::vector<bool>& moved = {});
  // CommitStep's part for one layer, on a worker, as soon as every piece of
  // `layer` has its statistics (so before the step's last reply lands):
  // the layer's commit from `piece_stats`, its pieces' (PieceStats, pieces
  // in partition order), moves x over the layer with `hyper` (its group's).
  // The same bits as CommitStep. The layer state stays as it was until
  // CommitStep. INVALID_ARGUMENT, nothing changed, for a wrong count of
  // statistics.
  absl::Status MoveLayer(int64_t step, size_t layer, const StepHyper* hyper,
                         absl::Span<const double> piece_stats);
  // The statistics of the segments of `partition` (a range of the model)
  // for the step of `step` (compress/layers.h's SegmentStatsOf), once its
  // reply has been applied.
  std::vector<double> SegmentStats(int64_t step, Range partition,
                                   const StepHyper* hyper = nullptr) const;
  // A shard's mirror: applies the optimizer's commit of `step` (from the
  // workers; onebit_lamb's layer coefficients move x) over [begin, begin +
  // n) and nothing else, so that partitions may apply their commits at
  // once from different threads. The optimizer's arrays that are not per
  // element after the commit (Optimizer::StateAfterCommit) are the caller's
  // to keep: CommitStep keeps them here, a shard keeps them with each
  // partition. INVALID_ARGUMENT, nothing changed, for a malformed commit or
  // range.
  absl::Status ApplyCommit(int64_t step, uint64_t begin, uint64_t n,
                           absl::Span<const double> commit,
                           const StepHyper* hyper = nullptr);
  absl::Span<const float> v_fresh() const { return v_fresh_; }
  absl::Span<float> mutable_v_fresh() { return absl::MakeSpan(v_fresh_); }
  // The layer rule's state (onebit_lamb's FlattenLambLayers order).
  absl::Span<const float> layer_state() const { return layer_state_; }

  // The optimizer's own state (Optimizer::State) over [begin, begin + n)
  // of the range: per-element arrays sliced to it, the others whole. The
  // one place that maps its arrays' names to this replica's storage.
  std::vector<NamedState> SaveState(uint64_t begin, uint64_t n) const;
  // Sets SaveState's form back: INVALID_ARGUMENT, nothing changed, unless
  // the range is inside the replica and CheckState accepts `state`.
  absl::Status RestoreState(uint64_t begin, uint64_t n,
                            absl::Span<const NamedState> state);

  uint64_t Checksum() const { return StateChecksum({x_, m_, v_}); }

 private:
  AlgorithmConfig config_;
  Range range_;
  std::vector<float> owned_x_, m_, v_;
  absl::Span<float> x_;
  // zero_one_adam's local phase on a worker: x at the last sync, the
  // update accumulated since (u), and the interval's learning-rate sum of
  // each segment.
  std::vector<float> anchor_, u_;
  std::vector<float> lr_sums_;
  int64_t local_step_ = -1;  // the last step LocalStep ran
  // The elementwise part of a local step (LocalStep's, or one begun by
  // BeginSyncLocalStep for `step`, whose ranges are still to run).
  struct LocalPass {
    int64_t step = -1;
    std::vector<AdamScalars> scalars;  // one per segment
    bool fresh = false, write_x = false;
  };
  LocalPass StartLocalStep(int64_t step, bool starts,
                           absl::Span<const StepHyper> hypers);
  // The pass's element loop over gradient g for elements [at, at + g.size())
  // of this replica.
  // With `sync`, a sync step's pass (write_x false) that also writes the
  // sync message of those elements into `message`.
  void RunLocalPass(const LocalPass& pass, size_t at, absl::Span<const float> g,
                    const AdamScalars* sync = nullptr,
                    absl::Span<float> message = {});
  LocalPass by_range_;
  // An optimizer with a layer rule (Optimizer::Layers): its per-element
  // array over the range (onebit_lamb's v') and its layer state.
  std::vector<float> v_fresh_;
  std::vector<float> layer_state_;
  void InitLayers();  // sizes both for such an optimizer

  // VarianceMask's knowledge of v, a word per block of the range: not
  // known, no 0 or some 0, in its low bits, and above them the generation
  // of v it holds for. mutable_v starts a generation (which forgets every
  // block at once); ApplyReply forgets the blocks it writes v in. Atomic
  // (relaxed): a restore of one partition may start a generation while
  // another partition's encode asks about its own blocks.
  enum : uint64_t { kZerosUnknown = 0, kNoZero = 1, kSomeZero = 2 };
  uint64_t zero_block_;
  struct Zeros {
    explicit Zeros(uint64_t blocks)
        : blocks(std::make_unique<std::atomic<uint64_t>[]>(blocks)) {}
    std::atomic<uint64_t> generation{0};
    std::unique_ptr<std::atomic<uint64_t>[]> blocks;
  };
  std::unique_ptr<Zeros> zeros_;  // a pointer, for the move constructor
  // Forgets the blocks that [at, at + n) of the range touches.
  void ForgetZeros(uint64_t at, uint64_t n);
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_REPLICA_H_
