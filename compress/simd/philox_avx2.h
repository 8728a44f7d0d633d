// Philox4x32-10 draws (stochastic_rounding.h's FillDraws) eight counters at
// a time in AVX2 registers: the same words, so the same floats, as the
// scalar generator. Included inside the unnamed namespace of avx2/ and
// avx512/kernels.cc (both compiled with -mavx2); not a public header.
//
// Lane l of the four counter vectors holds counter word k of group g + l;
// a round is the scalar round on every lane (the 32x32 -> 64-bit products
// from _mm256_mul_epu32 on the even and the odd lanes). The 32 words of a
// batch are then transposed into draw order (draw 4g + w is word w of group
// g).

struct PhiloxAvx2 {
  // hi and lo 32 bits of a * m per lane.
  static void MulHiLo(__m256i a, __m256i m, __m256i* hi, __m256i* lo) {
    const __m256i even = _mm256_mul_epu32(a, m);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  }

  // Words of groups group0 .. group0 + 7 (no carry into the high word
  // among them) -> 32 floats in draw order.
  static void Batch(uint32_t k0, uint32_t k1, uint32_t group_lo,
                    uint32_t group_hi, uint32_t step, uint32_t rank,
                    float* out) {
    const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
    const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(group_lo)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(group_hi));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(step));
    __m256i c3 = _mm256_set1_epi32(static_cast<int>(rank));
    for (int round = 0; round < 10; ++round) {
      __m256i hi0, lo0, hi1, lo1;
      MulHiLo(c0, m0, &hi0, &lo0);
      MulHiLo(c2, m1, &hi1, &lo1);
      const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
      const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), key0);
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), key1);
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // Transpose: t[l] = (c0[l], c1[l], c2[l], c3[l]) for l = 0..7.
    const __m256i a01 =
        _mm256_unpacklo_epi32(c0, c1);  // l0: c0 c1, l1: c0 c1 | l4, l5
    const __m256i a23 = _mm256_unpacklo_epi32(c2, c3);
    const __m256i b01 = _mm256_unpackhi_epi32(c0, c1);  // l2, l3 | l6, l7
    const __m256i b23 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i g0 = _mm256_unpacklo_epi64(a01, a23);  // group 0 | group 4
    const __m256i g1 = _mm256_unpackhi_epi64(a01, a23);  // group 1 | group 5
    const __m256i g2 = _mm256_unpacklo_epi64(b01, b23);  // group 2 | group 6
    const __m256i g3 = _mm256_unpackhi_epi64(b01, b23);  // group 3 | group 7
    const __m256i w[4] = {_mm256_permute2x128_si256(g0, g1, 0x20),
                          _mm256_permute2x128_si256(g2, g3, 0x20),
                          _mm256_permute2x128_si256(g0, g1, 0x31),
                          _mm256_permute2x128_si256(g2, g3, 0x31)};
    const __m256 unit = _mm256_set1_ps(0x1p-24f);
    for (int i = 0; i < 4; ++i) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_srli_epi32(w[i], 8));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(f, unit));
    }
  }

  static void FillDraws(const RoundingKey& key, float* out, size_t n) {
    size_t i = 0;
    // The scalar generator up to a group boundary, then whole batches of 8
    // groups (scalar again where a batch would carry into the high word),
    // then the scalar tail.
    const uint64_t head = (4 - key.first_index % 4) % 4;
    if (head > 0) {
      compress::FillDraws(key, out, std::min<size_t>(head, n));
      i = std::min<size_t>(head, n);
    }
    const uint32_t k0 = static_cast<uint32_t>(key.seed),
                   k1 = static_cast<uint32_t>(key.seed >> 32);
    for (; i + 32 <= n; i += 32) {
      const uint64_t group = (key.first_index + i) / 4;
      const uint32_t lo = static_cast<uint32_t>(group);
      if (lo > 0xFFFFFFFFu - 7) {
        RoundingKey k = key;
        k.first_index += i;
        compress::FillDraws(k, out + i, 32);
        continue;
      }
      Batch(k0, k1, lo, static_cast<uint32_t>(group >> 32),
            static_cast<uint32_t>(key.step), key.rank, out + i);
    }
    if (i < n) {
      RoundingKey k = key;
      k.first_index += i;
      compress::FillDraws(k, out + i, n - i);
    }
  }
};
