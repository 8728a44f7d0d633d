// sign1 (DESIGN 2.3) on the GPU: encode fused with error feedback, decode,
// and decode fused with 1-bit Adam's compression-phase update.
//
// Encode: a half-warp (16 threads) per scale block. Thread l accumulates the
// elements j = l, l + 16, ... of the block in increasing j, which is exactly
// lane l of the CPU's 16-lane order, and the half-warp reduces the lanes with
// the CPU's tree (i with i + 8, + 4, + 2, + 1) through shuffles: the scale is
// the same float as compress/'s. The second pass (signs, error update)
// re-reads the block, which is still in cache: one pass over DRAM.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

__global__ void Sign1EncodeKernel(const float* __restrict__ x,
                                  float* __restrict__ e, size_t n,
                                  uint32_t block, bool l1, int feedback,
                                  float beta, float* __restrict__ scales,
                                  uint8_t* __restrict__ bits, int* bad) {
  const HalfWarpBlock hb = ThisHalfWarpsBlock(x, e, n, block);
  const int lane = hb.lane;
  const int half = (threadIdx.x >> 4) & 1;
  const size_t b = hb.index, start = hb.start, len = hb.len;
  const float* xb = hb.x;
  float* eb = hb.e;

  float acc = 0.0f;
  // Unrolled so that a thread has several loads in flight; the adds still
  // run one after another in j order (the CPU's lane order).
#pragma unroll 8
  for (size_t j = lane; j < len; j += 16) {
    const float u = eb ? Add(xb[j], eb[j]) : xb[j];
    acc = Add(acc, l1 ? fabsf(u) : Mul(u, u));
  }
  for (int width = 8; width >= 1; width /= 2) {
    const float other = __shfl_down_sync(0xffffffffu, acc, width, 16);
    acc = Add(acc, other);
  }
  const float sum = __shfl_sync(0xffffffffu, acc, 0, 16);
  float s = 0.0f;
  bool ok = true;
  if (len > 0) {
    const float mean = Div(sum, static_cast<float>(len));
    s = l1 ? mean : Sqrt(mean);
    ok = IsFinite(s);
    if (lane == 0) {
      if (ok)
        scales[b] = s;
      else
        atomicOr(bad, 1);
    }
  }
  // Every thread of the warp runs the same number of rounds (ballots).
  const uint32_t rounds = (block + 15) / 16;
  for (uint32_t k = 0; k < rounds; ++k) {
    const size_t j = static_cast<size_t>(k) * 16 + lane;
    const bool valid = ok && j < len;
    float u = 0.0f;
    if (valid) u = eb ? Add(xb[j], eb[j]) : xb[j];
    const bool negative = valid && signbit(u);
    const uint32_t mask = __ballot_sync(0xffffffffu, negative);
    const uint32_t signs = (mask >> (16 * half)) & 0xffffu;
    // Elements 16k .. 16k+15 of the block are bytes (start + 16k)/8 and +1;
    // lanes 0 and 1 write them where they hold elements.
    if (ok && lane < 2 && static_cast<size_t>(k) * 16 + 8 * lane < len) {
      bits[(start + static_cast<size_t>(k) * 16) / 8 + lane] =
          static_cast<uint8_t>(signs >> (8 * lane));
    }
    if (valid && eb)
      eb[j] = NextError(feedback, beta, eb[j], u, negative ? -s : s);
  }
}

__global__ void Sign1DecodeKernel(const float* __restrict__ scales,
                                  const uint8_t* __restrict__ bits, size_t n,
                                  uint32_t block, float* __restrict__ out) {
  MORSE_FOR_EACH_ELEMENT(j, n) {
    const float s = scales[j / block];
    out[j] = (bits[j / 8] >> (j % 8)) & 1 ? -s : s;
  }
}

__global__ void Sign1DecodeFrozenKernel(const float* __restrict__ scales,
                                        const uint8_t* __restrict__ bits,
                                        size_t n, uint32_t block, Adam adam,
                                        float* __restrict__ x,
                                        float* __restrict__ m,
                                        const float* __restrict__ v) {
  MORSE_FOR_EACH_ELEMENT(j, n) {
    const float s = scales[j / block];
    FrozenElement(adam, (bits[j / 8] >> (j % 8)) & 1 ? -s : s, &x[j], &m[j],
                  v[j]);
  }
}

}  // namespace

cudaError_t Sign1Encode(const float* x, float* e, size_t n, uint32_t block,
                        bool l1, int feedback, float beta, float* scales,
                        uint8_t* bits, int* bad, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + block - 1) / block;
  Sign1EncodeKernel<<<BlockGrid(blocks), kThreads, 0, stream>>>(
      x, feedback == kFbNone ? nullptr : e, n, block, l1, feedback, beta,
      scales, bits, bad);
  return cudaGetLastError();
}

cudaError_t Sign1Decode(const float* scales, const uint8_t* bits, size_t n,
                        uint32_t block, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Sign1DecodeKernel<<<ElementGrid(n), kThreads, 0, stream>>>(scales, bits, n,
                                                             block, out);
  return cudaGetLastError();
}

cudaError_t Sign1DecodeFrozen(const float* scales, const uint8_t* bits,
                              size_t n, uint32_t block, AdamArgs adam, float* x,
                              float* m, const float* v, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Sign1DecodeFrozenKernel<<<ElementGrid(n), kThreads, 0, stream>>>(
      scales, bits, n, block, adam, x, m, v);
  return cudaGetLastError();
}

}  // namespace morse::kernels::launch
