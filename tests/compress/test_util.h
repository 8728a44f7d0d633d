// Helpers shared by the compress/ tests: seeded data with varied magnitudes
// and bit-exact comparisons.
#ifndef MORSE_TESTS_COMPRESS_TEST_UTIL_H_
#define MORSE_TESTS_COMPRESS_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/types/span.h"

namespace morse::compress::testing {

// Normal values scaled per 256-element run by 10^k, k in [-6, 3], with a few
// exact zeros and negative zeros, so scales and signs see every case.
inline std::vector<float> VariedData(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 3);
  std::vector<float> x(n);
  float magnitude = 1.0f;
  for (size_t j = 0; j < n; ++j) {
    if (j % 256 == 0)
      magnitude = std::pow(10.0f, static_cast<float>(exponent(rng)));
    x[j] = normal(rng) * magnitude;
    if (j % 97 == 5) x[j] = 0.0f;
    if (j % 101 == 7) x[j] = -0.0f;
  }
  return x;
}

inline bool SameBits(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
}

// The index of the first element whose bits differ, or -1.
inline long FirstBitDifference(absl::Span<const float> a,
                               absl::Span<const float> b) {
  for (size_t j = 0; j < a.size() && j < b.size(); ++j) {
    if (std::memcmp(&a[j], &b[j], 4) != 0) return static_cast<long>(j);
  }
  return a.size() == b.size() ? -1
                              : static_cast<long>(std::min(a.size(), b.size()));
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsFloatForTest(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace morse::compress::testing

#endif  // MORSE_TESTS_COMPRESS_TEST_UTIL_H_
