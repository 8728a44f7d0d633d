// The hot loops of compress/, behind one table of function pointers.
//
// There are three implementations with the same file names in their own
// folders: scalar/ (the portable reference, the oracle every other
// implementation and the CUDA kernels are tested against), avx2/ and avx512/.
// ActiveKernels() picks the widest one the CPU supports at run time, so the
// binary runs on any x86-64. Every implementation produces the same bytes and
// floats: sums for scales are accumulated in 16 lanes (element j in lane
// j mod 16, in increasing j) and the lanes are reduced by a fixed tree, see
// simd::ReduceLanes16 (pairwise halving: lane i with lane i + 8, then + 4,
// + 2, + 1).
//
// The kernels take raw pointers and trust their caller (the codec and update
// functions check sizes); blocks start at element 0 of the arrays passed in.
#ifndef MORSE_COMPRESS_KERNELS_H_
#define MORSE_COMPRESS_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <limits>

#include "compress/codec.h"

namespace morse::compress {

// Scalars of the element-wise Adam update (DESIGN 2.1, 2.2), computed once by
// the host so that every implementation sees the same fp32 values.
// bias_correction1/2 are 1 - beta^t, or exactly 1 when correction is off.
// max_ratio bounds |m̂/(sqrt(v̂)+eps)| in the frozen-variance update (DESIGN
// 2.1, bound_update); +inf, the default, leaves every ratio as it is.
struct AdamScalars {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float bias_correction1 = 1.0f;
  float bias_correction2 = 1.0f;
  float max_ratio = std::numeric_limits<float>::infinity();
};

// 1-bit LAMB's element scalars for one step (design.md 2.8): Adam's, whether
// v is frozen (the compression phase), and the bias correction of v'.
struct LambScalars {
  AdamScalars adam;
  bool frozen_variance = false;
  float fresh_correction2 = 1.0f;
};

// Stochastic rounding parameters; see stochastic_rounding.h.
struct StochasticArgs {
  RoundingKey key;
};

struct KernelTable {
  const char* name;

  // sign1 of x (+ e): writes ceil(n/block) scales and ceil(n/8) bytes of bits
  // (the last byte's unused bits zero) and updates e per fb. e may be null
  // only with kNone. Returns false if a scale is not finite; the blocks before
  // the failing one have then been written. mask_v (n floats, or null): the
  // zero-variance mask (ErrorFeedback::Compress), fused: where mask_v is
  // exactly 0, u = x + e is +0 and e is left +0, the bits of masking copies
  // of x and e first.
  bool (*sign1_encode)(const float* x, float* e, size_t n, size_t block,
                       ScaleKind scale, FeedbackArgs fb, float* scales,
                       uint8_t* bits, const float* mask_v);
  void (*sign1_decode)(const float* scales, const uint8_t* bits, size_t n,
                       size_t block, float* out);
  // out = (sum_i decode(i)) / count, sum from +0 in i order.
  void (*sign1_average)(const float* const* scales, const uint8_t* const* bits,
                        size_t count, size_t n, size_t block, float* out);

  // int8 (bits = 8) or int4 (bits = 4) of x (+ e), as sign1_encode. sr is
  // null for round-half-even.
  bool (*int_encode)(int bits_per_elem, const float* x, float* e, size_t n,
                     size_t block, FeedbackArgs fb, const StochasticArgs* sr,
                     float* scales, uint8_t* data);
  void (*int_decode)(int bits_per_elem, const float* scales,
                     const uint8_t* data, size_t n, size_t block, float* out);
  void (*int_average)(int bits_per_elem, const float* const* scales,
                      const uint8_t* const* data, size_t count, size_t n,
                      size_t block, float* out);

  // Adam on gradient g: m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
  // x = x - lr*((m/bc1) / (sqrt(v/bc2) + eps) + wd*x).
  void (*adam_update)(const AdamScalars& s, const float* g, float* x, float* m,
                      float* v, size_t n);
  // 1-bit Adam compression phase: m = c; x = x - lr*(m/(sqrt(v)+eps) + wd*x),
  // with c +0 where v is exactly 0 when `mask` (the zero-variance mask).
  void (*frozen_update)(const AdamScalars& s, const float* c, float* x,
                        float* m, const float* v, size_t n, bool mask);
  // out = b1*m + (1-b1)*g (a worker's local momentum in 1-bit Adam).
  void (*momentum)(float beta1, const float* m, const float* g, float* out,
                   size_t n);
  // 1-bit LAMB (design.md 2.8), the element direction u = p + wd*x with
  // p = m̂/(sqrt(v̂)+eps) (bounded once v is frozen): one segment's
  // statistics (n <= kSumSegment elements; compress/lamb.h's
  // LambSegmentSums: warmup [sum x^2, sum u^2, 0], compression [sum u^2,
  // sum p^2, max d/d']), and x = x - step*u over n elements.
  void (*lamb_segment_sums)(const LambScalars& s, const float* x,
                            const float* m, const float* v,
                            const float* v_fresh, size_t n, double out[3]);
  void (*lamb_update_x)(const LambScalars& s, float step, float* x,
                        const float* m, const float* v, size_t n);
  // Its moments from the decoded reply (simd::LambMomentsElement), masked
  // first when `mask`; v' = v at the last warmup step when copy_fresh.
  void (*lamb_moments)(const LambScalars& s, bool copy_fresh, bool mask,
                       const float* decoded, float* m, float* v, float* v_fresh,
                       size_t n);
  // zero_one_adam (design.md 2.7), compress/update_rules.h's loops: a
  // worker's local step over n elements (u read as +0 when `fresh`, the
  // interval's first step, so u need not be cleared first), its sync message
  // (lr_sum != 0), and every replica's sync update from the decoded reply w,
  // masked first when `mask` (anchor may be x itself).
  void (*zero_one_local_step)(const AdamScalars& s, const float* g, float* x,
                              float* m, float* u, const float* v, size_t n,
                              bool fresh, bool write_x);
  void (*zero_one_sync_message)(const AdamScalars& s, float lr_sum,
                                const float* u, const float* v, float* out,
                                size_t n);
  // A sync step's local step (x read, not written) and its sync message in
  // one pass: zero_one_local_step with write_x false, then
  // zero_one_sync_message(sync, lr_sum, u, v, out), the same bits.
  void (*zero_one_sync_local_step)(const AdamScalars& s,
                                   const AdamScalars& sync, float lr_sum,
                                   const float* g, const float* x, float* m,
                                   float* u, const float* v, size_t n,
                                   bool fresh, float* out);
  void (*zero_one_sync_step)(const AdamScalars& s, bool mask, const float* w,
                             const float* anchor, float* x, float* m,
                             const float* v, size_t n);
  // out[i] = the uniform draw of element key.first_index + i
  // (stochastic_rounding.h's FillDraws: the same floats, several Philox
  // counters at a time).
  void (*fill_draws)(const RoundingKey& key, float* out, size_t n);
};

// The portable reference.
const KernelTable& ScalarKernels();
// Null when the CPU (or the build) lacks the instruction set.
const KernelTable* Avx2Kernels();
const KernelTable* Avx512Kernels();

// The widest supported table, chosen once. The environment variable
// MORSE_SIMD=scalar|avx2|avx512 narrows the choice (for benchmarks and tests).
const KernelTable& ActiveKernels();

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_KERNELS_H_
