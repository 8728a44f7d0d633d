// int8 / int4 (DESIGN 2.3) on the GPU: encode with error feedback and
// round-half-even or counter-based stochastic rounding (the same Philox
// draws as compress/stochastic_rounding.h), and decode. The block's absolute
// maximum is a max of bit patterns, in any order, so the scale is the CPU's
// float exactly.
//
// Encode (staged, the usual path): a CTA per scale block reads u = x + e
// (and e for EMA) once into shared memory with 16-byte loads, reduces the
// maximum, then quantizes from shared memory, a byte of output per thread
// (one int8 element, or an int4 pair), and writes the new error: x and e are
// read once and e written once. Blocks too large to stage use the half-warp
// kernel, which reads each block twice.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

__global__ void IntEncodeKernel(int bits_per_elem, const float* __restrict__ x,
                                float* __restrict__ e, size_t n, uint32_t block,
                                int feedback, float beta, bool stochastic,
                                uint64_t seed, uint64_t step, uint32_t rank,
                                uint64_t first_index,
                                float* __restrict__ scales,
                                uint8_t* __restrict__ data, int* bad) {
  const HalfWarpBlock hb = ThisHalfWarpsBlock(x, e, n, block);
  const int lane = hb.lane;
  const size_t b = hb.index, start = hb.start, len = hb.len;
  const float* xb = hb.x;
  float* eb = hb.e;
  const float qmax = bits_per_elem == 8 ? 127.0f : 7.0f;

  uint32_t amax = 0;
  // Unrolled so that a thread has several loads in flight.
#pragma unroll 8
  for (size_t j = lane; j < len; j += 16) {
    const float u = eb ? Add(xb[j], eb[j]) : xb[j];
    amax = max(amax, __float_as_uint(u) & 0x7fffffffu);
  }
  for (int width = 8; width >= 1; width /= 2) {
    amax = max(amax, __shfl_down_sync(0xffffffffu, amax, width, 16));
  }
  amax = __shfl_sync(0xffffffffu, amax, 0, 16);
  const bool ok = len > 0 && amax < 0x7f800000u;
  float s = 0.0f;
  if (len > 0) {
    if (ok) {
      s = Div(__uint_as_float(amax), qmax);
      if (lane == 0) scales[b] = s;
    } else if (lane == 0) {
      atomicOr(bad, 1);
    }
  }
  const uint32_t rounds = (block + 15) / 16;
  for (uint32_t k = 0; k < rounds; ++k) {
    const size_t j = static_cast<size_t>(k) * 16 + lane;
    const bool valid = ok && j < len;
    float u = 0.0f, q = 0.0f;
    if (valid) {
      u = eb ? Add(xb[j], eb[j]) : xb[j];
      if (s != 0.0f) {
        const float v = Div(u, s);
        q = stochastic
                ? StochasticRound(v, StochasticDraw(seed, step, rank,
                                                    first_index + start + j))
                : rintf(v);
        q = Clamp(q, qmax);
      }
    }
    const int qi = static_cast<int>(q);
    if (bits_per_elem == 8) {
      if (valid)
        data[start + j] = static_cast<uint8_t>(static_cast<int8_t>(qi));
    } else {
      // Element j (even lane) and j + 1 share a byte: low nibble, high nibble.
      const int next = __shfl_down_sync(0xffffffffu, qi, 1, 16);
      if (valid && (lane & 1) == 0) {
        data[(start + j) / 2] = static_cast<uint8_t>(
            (qi & 0xF) | ((j + 1 < len ? next & 0xF : 0) << 4));
      }
    }
    if (valid && eb) eb[j] = NextError(feedback, beta, eb[j], u, Mul(q, s));
  }
}

constexpr int kStagedThreads = 256;
constexpr size_t kStagedSharedBytes = 48 * 1024;

__device__ __forceinline__ float Quantize(float u, float s, float qmax,
                                          bool stochastic, uint64_t seed,
                                          uint64_t step, uint32_t rank,
                                          uint64_t index) {
  if (s == 0.0f) return 0.0f;
  const float v = Div(u, s);
  const float q =
      stochastic ? StochasticRound(v, StochasticDraw(seed, step, rank, index))
                 : rintf(v);
  return Clamp(q, qmax);
}

template <bool kVector>
__global__ void __launch_bounds__(kStagedThreads)
    IntEncodeStagedKernel(int bits_per_elem, const float* __restrict__ x,
                          float* __restrict__ e, size_t n, uint32_t block,
                          int feedback, float beta, bool stochastic,
                          uint64_t seed, uint64_t step, uint32_t rank,
                          uint64_t first_index, float* __restrict__ scales,
                          uint8_t* __restrict__ data, int* bad) {
  extern __shared__ float staged[];
  float* u = staged;              // x + e, block floats
  float* e_old = staged + block;  // e, for EMA only
  __shared__ uint32_t warp_max[kStagedThreads / 32];
  const size_t b = blockIdx.x;
  const size_t start = b * block;
  const uint32_t len =
      static_cast<uint32_t>(n - start < block ? n - start : block);
  const bool ema = e != nullptr && feedback == kFbEma;
  const float* xb = x + start;
  float* eb = e == nullptr ? nullptr : e + start;
  const float qmax = bits_per_elem == 8 ? 127.0f : 7.0f;

  uint32_t amax = 0;
  StageBlock<kVector>(
      xb, eb, nullptr, 0.0f, len, u, e_old, ema,
      [&amax](float v) { amax = max(amax, __float_as_uint(v) & 0x7fffffffu); });
  for (int width = 16; width >= 1; width /= 2) {
    amax = max(amax, __shfl_down_sync(0xffffffffu, amax, width));
  }
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  __shared__ float scale;
  __shared__ bool scale_ok;
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < kStagedThreads / 32; ++w) m = max(m, warp_max[w]);
    const bool ok = m < 0x7f800000u;
    const float s = ok ? Div(__uint_as_float(m), qmax) : 0.0f;
    if (ok)
      scales[b] = s;
    else
      atomicOr(bad, 1);
    scale = s;
    scale_ok = ok;
  }
  __syncthreads();
  if (!scale_ok) return;
  const float s = scale;
  const uint64_t first = first_index + start;

  if (bits_per_elem == 8) {
    for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
      const float q =
          Quantize(u[j], s, qmax, stochastic, seed, step, rank, first + j);
      data[start + j] =
          static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q)));
      if (eb != nullptr) {
        eb[j] =
            NextError(feedback, beta, ema ? e_old[j] : 0.0f, u[j], Mul(q, s));
      }
    }
    return;
  }
  // int4: thread i writes the byte of elements 2i and 2i + 1.
  const uint32_t pairs = (len + 1) / 2;
  for (uint32_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t k = 0; k < 2; ++k) {
      const uint32_t j = 2 * i + k;
      if (j >= len) break;
      const float q =
          Quantize(u[j], s, qmax, stochastic, seed, step, rank, first + j);
      byte |= (static_cast<uint32_t>(static_cast<int>(q)) & 0xFu) << (4 * k);
      if (eb != nullptr) {
        eb[j] =
            NextError(feedback, beta, ema ? e_old[j] : 0.0f, u[j], Mul(q, s));
      }
    }
    data[(start / 2) + i] = static_cast<uint8_t>(byte);
  }
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

cudaError_t IntEncode(int bits_per_elem, const float* x, float* e, size_t n,
                      uint32_t block, int feedback, float beta, bool stochastic,
                      uint64_t seed, uint64_t step, uint32_t rank,
                      uint64_t first_index, float* scales, uint8_t* data,
                      int* bad, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + block - 1) / block;
  float* error = feedback == kFbNone ? nullptr : e;
  const size_t shared = size_t{block} * 4 * (feedback == kFbEma ? 2 : 1);
  // int4 packs pairs: blocks must start on a byte (block_elems is a multiple
  // of 16 by the layout's rule).
  if (block % 16 == 0 && shared <= kStagedSharedBytes && blocks < (1u << 31)) {
    if (Aligned16(x) && (error == nullptr || Aligned16(error))) {
      IntEncodeStagedKernel<true>
          <<<static_cast<unsigned>(blocks), kStagedThreads, shared, stream>>>(
              bits_per_elem, x, error, n, block, feedback, beta, stochastic,
              seed, step, rank, first_index, scales, data, bad);
    } else {
      IntEncodeStagedKernel<false>
          <<<static_cast<unsigned>(blocks), kStagedThreads, shared, stream>>>(
              bits_per_elem, x, error, n, block, feedback, beta, stochastic,
              seed, step, rank, first_index, scales, data, bad);
    }
    return cudaGetLastError();
  }
  IntEncodeKernel<<<BlockGrid(blocks), kThreads, 0, stream>>>(
      bits_per_elem, x, feedback == kFbNone ? nullptr : e, n, block, feedback,
      beta, stochastic, seed, step, rank, first_index, scales, data, bad);
  return cudaGetLastError();
}

cudaError_t IntDecode(int bits_per_elem, const float* scales,
                      const uint8_t* data, size_t n, uint32_t block, float* out,
                      cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    int q;
    if (bits_per_elem == 8) {
      q = static_cast<int8_t>(data[j]);
    } else {
      q = (((data[j / 2] >> (4 * (j & 1))) & 0xF) ^ 8) - 8;
    }
    out[j] = Mul(static_cast<float>(q), scales[j / block]);
  });
}

}  // namespace morse::kernels::launch
