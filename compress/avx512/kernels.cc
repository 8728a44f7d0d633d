// KernelTable for AVX-512 (F, BW, VL): 16 fp32 lanes. Compiled with
// -mavx512f -mavx512bw -mavx512vl; reached only through Avx512Kernels(),
// which checks the CPU first.
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

struct Avx512 {
  static void FillDraws(const RoundingKey& key, float* out, size_t n) {
    PhiloxAvx2::FillDraws(key, out, n);
  }
  using F = __m512;
  using I = __m512i;
  static constexpr size_t kWidth = 16;

  static F Zero() { return _mm512_setzero_ps(); }
  static I ZeroI() { return _mm512_setzero_si512(); }
  static F Set1(float f) { return _mm512_set1_ps(f); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void StoreStream(float* p, F v) { _mm512_stream_ps(p, v); }
  static void Fence() { _mm_sfence(); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  // +0 in the lanes where v == 0 (ordered: NaN is not 0), else w.
  static F ZeroWhereZero(F v, F w) {
    return _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ), w);
  }
  static I AbsBits(F a) {
    return _mm512_and_si512(_mm512_castps_si512(a),
                            _mm512_set1_epi32(0x7fffffff));
  }
  static F Abs(F a) { return _mm512_castsi512_ps(AbsBits(a)); }
  static I MaxU32(I a, I b) { return _mm512_max_epu32(a, b); }
  static uint32_t HMaxU32(I a) { return _mm512_reduce_max_epu32(a); }
  static F RoundEven(F a) {
    return _mm512_roundscale_ps(a,
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // s (non-negative) with u's sign bit: the sign1 value of u.
  static F CopySign(F s, F u) {
    const I sign = _mm512_and_si512(_mm512_castps_si512(u),
                                    _mm512_set1_epi32(int32_t(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(s), sign));
  }
  static uint32_t SignBits(F u) {
    return _mm512_cmplt_epi32_mask(_mm512_castps_si512(u),
                                   _mm512_setzero_si512());
  }
  static void StoreBits(uint8_t* p, uint32_t bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    std::memcpy(p, &b, 2);
  }
  static uint32_t LoadBits(const uint8_t* p) {
    uint16_t b;
    std::memcpy(&b, p, 2);
    return b;
  }
  static F ApplySigns(F s, uint32_t bits) {
    const I neg = _mm512_maskz_mov_epi32(
        static_cast<__mmask16>(bits), _mm512_set1_epi32(int32_t(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(s), neg));
  }
  static void StoreInt8(uint8_t* p, F q) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
  // 16 values -> 8 bytes, element 2k in the low nibble of byte k.
  static void StoreInt4(uint8_t* p, F q) {
    const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x000F));
    const __m128i hi =
        _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00F0));
    _mm_storel_epi64(
        reinterpret_cast<__m128i*>(p),
        _mm_packus_epi16(_mm_or_si128(lo, hi), _mm_setzero_si128()));
  }
  static F LoadInt8(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static F LoadInt4(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m128i nib = _mm_unpacklo_epi8(lo, hi);
    nib = _mm_sub_epi8(_mm_xor_si128(nib, eight), eight);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(nib));
  }
};

#include "compress/simd/vector_kernels.inc"

}  // namespace

const KernelTable* Avx512Kernels() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  static constexpr KernelTable kTable = VectorKernels<Avx512>::Table("avx512");
  return supported ? &kTable : nullptr;
}

}  // namespace morse::compress
