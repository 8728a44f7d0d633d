// KernelTable for AVX2: 8 fp32 lanes, two accumulators to keep the 16-lane
// sum order. Compiled with -mavx2 (no FMA: element updates must not
// contract); reached only through Avx2Kernels(), which checks the CPU first.
#include "compress/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compress/simd/element_ops.h"
#include "compress/stochastic_rounding.h"

namespace morse::compress {
namespace {

#include "compress/simd/philox_avx2.h"

struct Avx2 {
  static void FillDraws(const RoundingKey& key, float* out, size_t n) {
    PhiloxAvx2::FillDraws(key, out, n);
  }
  using F = __m256;
  using I = __m256i;
  static constexpr size_t kWidth = 8;

  static F Zero() { return _mm256_setzero_ps(); }
  static I ZeroI() { return _mm256_setzero_si256(); }
  static F Set1(float f) { return _mm256_set1_ps(f); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void StoreStream(float* p, F v) { _mm256_stream_ps(p, v); }
  static void Fence() { _mm_sfence(); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  // +0 in the lanes where v == 0 (ordered: NaN is not 0), else w.
  static F ZeroWhereZero(F v, F w) {
    return _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ),
                            w);
  }
  static I AbsBits(F a) {
    return _mm256_and_si256(_mm256_castps_si256(a),
                            _mm256_set1_epi32(0x7fffffff));
  }
  static F Abs(F a) { return _mm256_castsi256_ps(AbsBits(a)); }
  static I MaxU32(I a, I b) { return _mm256_max_epu32(a, b); }
  static uint32_t HMaxU32(I a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a),
                              _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static F RoundEven(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F CopySign(F s, F u) {
    const F sign = _mm256_and_ps(
        u, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u))));
    return _mm256_or_ps(s, sign);
  }
  static uint32_t SignBits(F u) {
    return static_cast<uint32_t>(_mm256_movemask_ps(u));
  }
  static void StoreBits(uint8_t* p, uint32_t bits) {
    *p = static_cast<uint8_t>(bits);
  }
  static uint32_t LoadBits(const uint8_t* p) { return *p; }
  static F ApplySigns(F s, uint32_t bits) {
    const I lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const I hit = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit),
        lane_bit);
    const I neg =
        _mm256_and_si256(hit, _mm256_set1_epi32(int32_t(0x80000000u)));
    return _mm256_or_ps(s, _mm256_castsi256_ps(neg));
  }
  // 8 values -> 8 int8 in the low half of a 128-bit register.
  static __m128i PackInt8(F q) {
    const I q32 = _mm256_cvtps_epi32(q);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32),
                                        _mm256_extracti128_si256(q32, 1));
    return _mm_packs_epi16(q16, q16);
  }
  static void StoreInt8(uint8_t* p, F q) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), PackInt8(q));
  }
  static void StoreInt4(uint8_t* p, F q) {
    const __m128i b = PackInt8(q);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x000F));
    const __m128i hi =
        _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00F0));
    const int32_t packed =
        _mm_cvtsi128_si32(_mm_packus_epi16(_mm_or_si128(lo, hi), lo));
    std::memcpy(p, &packed, 4);
  }
  static F LoadInt8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F LoadInt4(const uint8_t* p) {
    int32_t raw;
    std::memcpy(&raw, p, 4);
    const __m128i b = _mm_cvtsi32_si128(raw);
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m128i nib = _mm_unpacklo_epi8(lo, hi);
    nib = _mm_sub_epi8(_mm_xor_si128(nib, eight), eight);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(nib));
  }
};

#include "compress/simd/vector_kernels.inc"

}  // namespace

const KernelTable* Avx2Kernels() {
  static const bool supported = __builtin_cpu_supports("avx2");
  static constexpr KernelTable kTable = VectorKernels<Avx2>::Table("avx2");
  return supported ? &kTable : nullptr;
}

}  // namespace morse::compress
