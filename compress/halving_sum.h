// The fixed summation order of design.md 2.6 and 2.8, which a GPU CTA can
// follow: values in segments of kSumSegment, each segment added by halving.
// GradientSumOfSquares and onebit_lamb's layer sums both use it, and
// kernels/optimizers.cu repeats it in shared memory. Internal linkage, as in
// simd/element_ops.h: the avx2/ and avx512/ kernels use it too, and their
// copies must not stand in for the portable ones.
#ifndef MORSE_COMPRESS_HALVING_SUM_H_
#define MORSE_COMPRESS_HALVING_SUM_H_

#include <cstdint>

namespace morse::compress {

inline constexpr uint64_t kSumSegment = 256;

// One level of the tree: t[i] = t[i] + t[i + H] for i < H. A constant H
// lets the compiler add several i at once (each i is its own sum: the same
// bits).
template <uint64_t H>
static inline void HalveOnce(double* t) {
  for (uint64_t i = 0; i < H; ++i) t[i] = t[i] + t[i + H];
  if constexpr (H > 1) HalveOnce<H / 2>(t);
}

// t[i] = t[i] + t[i + h] for i < h, h = kSumSegment/2, ..., 1, over a
// segment's kSumSegment terms (+0 past its end); returns t[0].
static inline double HalvingSum(double* t) {
  HalveOnce<kSumSegment / 2>(t);
  return t[0];
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_HALVING_SUM_H_
