// The fixed summation order of design.md 2.6 and 2.8, which a GPU CTA can
// follow: values in segments of kSumSegment, each segment added by halving.
// GradientSumOfSquares and onebit_lamb's layer sums both use it, and
// kernels/optimizers.cu repeats it in shared memory.
#ifndef MORSE_COMPRESS_HALVING_SUM_H_
#define MORSE_COMPRESS_HALVING_SUM_H_

#include <cstdint>

namespace morse::compress {

inline constexpr uint64_t kSumSegment = 256;

// t[i] = t[i] + t[i + h] for i < h, h = kSumSegment/2, ..., 1, over a
// segment's kSumSegment terms (+0 past its end); returns t[0].
inline double HalvingSum(double* t) {
  for (uint64_t h = kSumSegment / 2; h >= 1; h /= 2) {
    for (uint64_t i = 0; i < h; ++i) t[i] = t[i] + t[i + h];
  }
  return t[0];
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_HALVING_SUM_H_
