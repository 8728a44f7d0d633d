// Counter-based random draws for stochastic rounding (DESIGN 2.3).
//
// Philox4x32-10 (Salmon et al., SC'11), the generator cuRAND also offers, so
// that a CUDA kernel computes the same draws as this header. For element with
// global index i of (seed, step, rank):
//   key     = (low32(seed), high32(seed))
//   counter = (low32(i/4), high32(i/4), low32(step), rank)
//   word    = Philox4x32_10(key, counter)[i mod 4]
//   draw    = (word >> 8) * 2^-24, uniform in [0, 1)
// Stochastic rounding of v is floor(v) + (draw < v - floor(v) ? 1 : 0).
// Header-only and free of state; safe from any thread.
#ifndef MORSE_COMPRESS_STOCHASTIC_ROUNDING_H_
#define MORSE_COMPRESS_STOCHASTIC_ROUNDING_H_

#include <array>
#include <cmath>
#include <cstdint>

#include "compress/codec.h"

namespace morse::compress {

inline std::array<uint32_t, 4> Philox4x32_10(std::array<uint32_t, 2> key,
                                             std::array<uint32_t, 4> ctr) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * ctr[0];
    const uint64_t p1 = uint64_t{kMul1} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0],
           static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1],
           static_cast<uint32_t>(p0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

// The uniform draw in [0, 1) for global element `index` (see above).
inline float StochasticDraw(const RoundingKey& key, uint64_t index) {
  const uint64_t group = index / 4;
  const auto words = Philox4x32_10(
      {static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32)},
      {static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
       static_cast<uint32_t>(key.step), key.rank});
  return static_cast<float>(words[index % 4] >> 8) * 0x1p-24f;
}

// out[i] = StochasticDraw(key, key.first_index + i), four draws per Philox
// call: for bulk random numbers (synthetic workloads, tests).
inline void FillDraws(const RoundingKey& key, float* out, size_t n) {
  for (size_t i = 0; i < n;) {
    const uint64_t index = key.first_index + i;
    const uint64_t group = index / 4;
    const auto words = Philox4x32_10(
        {static_cast<uint32_t>(key.seed),
         static_cast<uint32_t>(key.seed >> 32)},
        {static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
         static_cast<uint32_t>(key.step), key.rank});
    for (uint64_t w = index % 4; w < 4 && i < n; ++w, ++i) {
      out[i] = static_cast<float>(words[w] >> 8) * 0x1p-24f;
    }
  }
}

// floor(v) + (draw < frac(v)), exact in fp32 for |v| < 2^23.
inline float StochasticRound(float v, float draw) {
  const float f = std::floor(v);
  return (draw < v - f) ? f + 1.0f : f;
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_STOCHASTIC_ROUNDING_H_
