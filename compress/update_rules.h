// The optimizer updates of DESIGN 2.1 and 2.2 as functions on spans, and the
// learning-rate schedule. Every function runs on ActiveKernels(), whose
// implementations give identical bits (no FMA contraction, no fast-math).
// Spans passed together must have equal sizes (checked; a mismatch aborts).
#ifndef MORSE_COMPRESS_UPDATE_RULES_H_
#define MORSE_COMPRESS_UPDATE_RULES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compress/kernels.h"

namespace morse::compress {

struct AdamHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

absl::Status ValidateAdamHyper(const AdamHyper& hyper);

// Learning rate gamma_t for step t (0-based): linear warmup from 0 over
// warmup_steps, then constant or cosine decay to min_lr at total_steps.
struct LrSchedule {
  enum class Kind : uint8_t { kConstant, kCosine };
  Kind kind = Kind::kConstant;
  float base_lr = 1e-3f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // kCosine only
  float min_lr = 0.0f;      // kCosine only
};

absl::Status ValidateLrSchedule(const LrSchedule& schedule);
// Computed in double and rounded once to fp32, so every process agrees.
float LearningRate(const LrSchedule& schedule, int64_t step);

// The fp32 scalars of one update. `t` is the 1-based count of Adam updates
// for bias correction, which is applied only when `bias_correction` is true
// (1 - beta^t computed in double, rounded once).
AdamScalars MakeAdamScalars(const AdamHyper& hyper, float lr, int64_t t,
                            bool bias_correction);

// The bound of DESIGN 2.1's bound_update: Adam's own largest step per unit of
// learning rate (Kingma & Ba 2015, section 2.1), max(1, (1-b1)/sqrt(1-b2)),
// computed in double from the fp32 betas and rounded once (3.1630 for the
// defaults 0.9f, 0.999f).
float OneBitUpdateBound(const AdamHyper& hyper);

// Adam (DESIGN 2.2; with bias_correction1/2 == 1 it is the 1-bit Adam warmup
// step of 2.1): m, v from g, then x.
void AdamStep(const AdamScalars& s, absl::Span<const float> g,
              absl::Span<float> x, absl::Span<float> m, absl::Span<float> v);

// 1-bit Adam compression phase (2.1): m = c (the decoded server reply), v
// frozen, then x.
// With `mask`, c is taken as +0 where v is exactly 0 (the zero-variance
// mask, in the same pass).
void FrozenVarianceStep(const AdamScalars& s, absl::Span<const float> c,
                        absl::Span<float> x, absl::Span<float> m,
                        absl::Span<const float> v, bool mask = false);

// A worker's local momentum in the compression phase: out = b1*m + (1-b1)*g.
void LocalMomentum(float beta1, absl::Span<const float> m,
                   absl::Span<const float> g, absl::Span<float> out);

// diloco's outer step (design.md 2.11): SGD with momentum on the averaged
// pseudo-gradient d (the decoded reply), in this fp32 order:
//   m = momentum*m + d;  x = x - lr*(nesterov ? d + momentum*m : m).
// A plain loop: it runs once per sync_every inner steps. With momentum 0
// and lr 1 it sets x to x - d, the average of the workers' models.
struct OuterScalars {
  float lr = 0.7f;
  float momentum = 0.9f;
  bool nesterov = true;
};
void OuterStep(const OuterScalars& s, absl::Span<const float> d,
               absl::Span<float> x, absl::Span<float> m);

// zero_one_adam (design.md 2.7): simd/element_ops.h's ZeroOne*Element in
// one fixed fp32 order, through ActiveKernels() (the variance step is a plain
// loop: it runs only before the freeze).
//
// A variance step (s in T_v before the freeze): Adam's step with the ratio
// bounded, r = bound((m/bc1) / (sqrt(v/bc2) + eps)), as the other steps of
// the optimizer are (design.md 2.7).
void ZeroOneVarianceStep(const AdamScalars& s, absl::Span<const float> g,
                         absl::Span<float> x, absl::Span<float> m,
                         absl::Span<float> v);
// One worker's local step: m = b1*m + (1-b1)*g; r = bound((m/bc1) /
// (sqrt(v/bc2) + eps)); d = r + wd*x; u = u + lr*d (u read as +0 when
// `fresh`, the interval's first step); x = x - lr*d unless !write_x (a sync
// step, whose x comes from the reply).
void ZeroOneLocalStep(const AdamScalars& s, absl::Span<const float> g,
                      absl::Span<float> x, absl::Span<float> m,
                      absl::Span<float> u, absl::Span<const float> v,
                      bool write_x, bool fresh = false);
// A worker's sync message: out = (u * (sqrt(v/bc2) + eps)) / lr_sum, the
// learning-rate-weighted mean of its local momenta since the last sync; its
// own m where lr_sum is 0.
void ZeroOneSyncMessage(const AdamScalars& s, float lr_sum,
                        absl::Span<const float> u, absl::Span<const float> m,
                        absl::Span<const float> v, absl::Span<float> out);
// A sync step's local step (x read, not written) and then its sync message
// with `sync`'s scalars, in one pass: ZeroOneLocalStep(write_x false) and
// ZeroOneSyncMessage(sync, lr_sum, u, m, v, out), the same bits.
void ZeroOneSyncLocalStep(const AdamScalars& s, const AdamScalars& sync,
                          float lr_sum, absl::Span<const float> g,
                          absl::Span<float> x, absl::Span<float> m,
                          absl::Span<float> u, absl::Span<const float> v,
                          bool fresh, absl::Span<float> out);
// Every replica's sync update from the decoded reply w, with s.lr the
// interval's learning-rate sum: x = anchor - lr_sum * bound(w / (sqrt(v/bc2)
// + eps)); m = w, w first masked (+0 where v is 0) when `mask`. `anchor` (x
// at the last sync) may be x itself (a shard's mirror never leaves it).
void ZeroOneSyncStep(const AdamScalars& s, absl::Span<const float> w,
                     absl::Span<const float> anchor, absl::Span<float> x,
                     absl::Span<float> m, absl::Span<const float> v,
                     bool mask = false);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_UPDATE_RULES_H_
