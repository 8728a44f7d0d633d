// sign1 (DESIGN 2.3) on the GPU: encode fused with error feedback, decode,
// and decode fused with 1-bit Adam's compression-phase update.
//
// Encode (staged, the usual path): a CTA per scale block. The CTA reads the
// block once from DRAM into shared memory (u = x + e, and e for EMA), with
// 16-byte loads; then thread l < 16 of the first warp accumulates the
// elements j = l, l + 16, ... of u in increasing j, which is exactly lane l
// of the CPU's 16-lane order, and the 16 lanes reduce with the CPU's tree
// (i with i + 8, + 4, + 2, + 1) through shuffles: the scale is the same float
// as compress/'s. Then every thread writes signs (a ballot per 32 elements)
// and the new error from shared memory: x and e are read once and e written
// once. Blocks whose staging would not fit in shared memory use the
// half-warp kernel below, which reads the block twice (the second time
// mostly from cache).
//
// Decode: a thread per 4 elements (one scale, half a byte of signs) with
// 16-byte loads and stores that a warp makes contiguous, and one 32-bit
// division per 4 elements; the per-element kernels serve unaligned arrays.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

__global__ void Sign1EncodeKernel(const float* __restrict__ x,
                                  float* __restrict__ e, size_t n,
                                  uint32_t block, bool l1, int feedback,
                                  float beta, const float* __restrict__ mask_v,
                                  float* __restrict__ scales,
                                  uint8_t* __restrict__ bits, int* bad) {
  const HalfWarpBlock hb = ThisHalfWarpsBlock(x, e, n, block);
  const int lane = hb.lane;
  const int half = (threadIdx.x >> 4) & 1;
  const size_t b = hb.index, start = hb.start, len = hb.len;
  const float* xb = hb.x;
  float* eb = hb.e;
  const float* vb = mask_v == nullptr ? nullptr : mask_v + start;

  float acc = 0.0f;
  // Unrolled so that a thread has several loads in flight; the adds still
  // run one after another in j order (the CPU's lane order).
#pragma unroll 8
  for (size_t j = lane; j < len; j += 16) {
    float u = eb ? Add(xb[j], eb[j]) : xb[j];
    if (vb != nullptr && vb[j] == 0.0f) u = 0.0f;
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
    const bool masked = valid && vb != nullptr && vb[j] == 0.0f;
    if (valid && !masked) u = eb ? Add(xb[j], eb[j]) : xb[j];
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
      eb[j] = masked ? 0.0f
                     : NextError(feedback, beta, eb[j], u, negative ? -s : s);
  }
}

constexpr int kStagedThreads = 256;
constexpr size_t kStagedSharedBytes = 48 * 1024;

__device__ __forceinline__ float SignedScale(uint32_t bits, int k, float s) {
  return (bits >> k) & 1 ? -s : s;
}

template <bool kVector>
__global__ void __launch_bounds__(kStagedThreads)
    Sign1EncodeStagedKernel(const float* __restrict__ x, float* __restrict__ e,
                            size_t n, uint32_t block, bool l1, int feedback,
                            float beta, const float* __restrict__ mask_v,
                            float* __restrict__ scales,
                            uint8_t* __restrict__ bits, int* bad,
                            const float* __restrict__ mom_m, float beta1) {
  extern __shared__ float staged[];
  float* u = staged;              // x + e, block floats
  float* e_old = staged + block;  // e, for EMA only
  __shared__ float scale;
  __shared__ bool scale_ok;
  const size_t b = blockIdx.x;
  const size_t start = b * block;
  const uint32_t len =
      static_cast<uint32_t>(n - start < block ? n - start : block);
  const bool ema = e != nullptr && feedback == kFbEma;
  const float* xb = x + start;
  float* eb = e == nullptr ? nullptr : e + start;
  const float* vb = mask_v == nullptr ? nullptr : mask_v + start;
  // The local momentum b1*m + (1-b1)*g in place of x, when asked.
  const float* mb = mom_m == nullptr ? nullptr : mom_m + start;

  // Stage the block: 16-byte loads where the arrays are aligned.
  StageBlock<kVector>(xb, eb, mb, beta1, len, u, e_old, ema, [](float) {});
  if (vb != nullptr) {
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
      if (vb[j] == 0.0f) u[j] = 0.0f;
    }
  }
  __syncthreads();

  // The scale, in the CPU's order.
  if (threadIdx.x < 32) {
    const uint32_t lane = threadIdx.x & 15;
    float acc = 0.0f;
    if (threadIdx.x < 16) {
#pragma unroll 8
      for (uint32_t j = lane; j < len; j += 16) {
        const float v = u[j];
        acc = Add(acc, l1 ? fabsf(v) : Mul(v, v));
      }
    }
    for (int width = 8; width >= 1; width /= 2) {
      const float other = __shfl_down_sync(0xffffffffu, acc, width, 16);
      acc = Add(acc, other);
    }
    if (threadIdx.x == 0) {
      const float mean = Div(acc, static_cast<float>(len));
      const float s = l1 ? mean : Sqrt(mean);
      const bool ok = IsFinite(s);
      if (ok)
        scales[b] = s;
      else
        atomicOr(bad, 1);
      scale = s;
      scale_ok = ok;
    }
  }
  __syncthreads();
  if (!scale_ok) return;
  const float s = scale;

  // Signs and the new error. Every thread runs the same rounds (ballots);
  // a warp's 32 elements are 4 bytes of signs, written by lanes 0..3.
  const uint32_t lane = threadIdx.x & 31;
  for (uint32_t base = 0; base < len; base += blockDim.x) {
    const uint32_t j = base + threadIdx.x;
    const bool valid = j < len;
    const float v = valid ? u[j] : 0.0f;
    const bool negative = valid && signbit(v);
    const uint32_t mask = __ballot_sync(0xffffffffu, negative);
    const uint32_t warp_first = j - lane;
    if (lane < 4 && warp_first + 8 * lane < len) {
      bits[(start + warp_first) / 8 + lane] =
          static_cast<uint8_t>(mask >> (8 * lane));
    }
    if (valid && eb != nullptr) {
      eb[j] = vb != nullptr && vb[j] == 0.0f
                  ? 0.0f
                  : NextError(feedback, beta, ema ? e_old[j] : 0.0f, v,
                              negative ? -s : s);
    }
  }
}

__device__ __forceinline__ size_t BlockOf(size_t j, uint32_t block) {
  // 32-bit division where it suffices: far cheaper than 64-bit.
  return j <= 0xffffffffu ? static_cast<uint32_t>(j) / block : j / block;
}

// A thread per 4 elements (half a byte of signs, one scale): a warp's
// 16-byte stores cover 512 contiguous bytes.
__device__ __forceinline__ float4 DecodeQuad(const float* __restrict__ scales,
                                             const uint8_t* __restrict__ bits,
                                             size_t j, uint32_t block) {
  const float s = scales[BlockOf(j, block)];
  const uint32_t nibble = bits[j / 8] >> (j % 8);
  return make_float4(SignedScale(nibble, 0, s), SignedScale(nibble, 1, s),
                     SignedScale(nibble, 2, s), SignedScale(nibble, 3, s));
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

cudaError_t Sign1Encode(const float* x, float* e, size_t n, uint32_t block,
                        bool l1, int feedback, float beta, const float* mask_v,
                        float* scales, uint8_t* bits, int* bad,
                        cudaStream_t stream, MomentumInput momentum) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + block - 1) / block;
  const float* error = feedback == kFbNone ? nullptr : e;
  const size_t shared = size_t{block} * 4 * (feedback == kFbEma ? 2 : 1);
  if (block % 8 == 0 && shared <= kStagedSharedBytes && blocks < (1u << 31)) {
    const bool vector = Aligned16(x) &&
                        (error == nullptr || Aligned16(error)) &&
                        (momentum.m == nullptr || Aligned16(momentum.m));
    if (vector) {
      Sign1EncodeStagedKernel<true>
          <<<static_cast<unsigned>(blocks), kStagedThreads, shared, stream>>>(
              x, feedback == kFbNone ? nullptr : e, n, block, l1, feedback,
              beta, mask_v, scales, bits, bad, momentum.m, momentum.beta1);
    } else {
      Sign1EncodeStagedKernel<false>
          <<<static_cast<unsigned>(blocks), kStagedThreads, shared, stream>>>(
              x, feedback == kFbNone ? nullptr : e, n, block, l1, feedback,
              beta, mask_v, scales, bits, bad, momentum.m, momentum.beta1);
    }
    return cudaGetLastError();
  }
  if (momentum.m != nullptr) {
    // The half-warp kernel reads its input twice: form the momentum first.
    if (cudaError_t err = Momentum(momentum.beta1, momentum.m, x,
                                   momentum.scratch, n, stream);
        err != cudaSuccess) {
      return err;
    }
    x = momentum.scratch;
  }
  Sign1EncodeKernel<<<BlockGrid(blocks), kThreads, 0, stream>>>(
      x, feedback == kFbNone ? nullptr : e, n, block, l1, feedback, beta,
      mask_v, scales, bits, bad);
  return cudaGetLastError();
}

// A reply decoded (and, below, applied as the frozen update) a thread per 4
// elements where the buffers allow 16-byte loads and stores (a warp's stores
// then cover 512 contiguous bytes; the last quad may be short), else a
// thread per element.
cudaError_t Sign1Decode(const float* scales, const uint8_t* bits, size_t n,
                        uint32_t block, float* out, cudaStream_t stream) {
  if (block % 4 == 0 && Aligned16(out)) {
    return ForEachElement((n + 3) / 4, stream, [=] __device__(size_t q) {
      if (4 * q + 4 <= n) {
        reinterpret_cast<float4*>(out)[q] =
            DecodeQuad(scales, bits, 4 * q, block);
        return;
      }
      for (size_t j = 4 * q; j < n; ++j)
        out[j] = SignedScale(bits[j / 8], j % 8, scales[BlockOf(j, block)]);
    });
  }
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float s = scales[j / block];
    out[j] = (bits[j / 8] >> (j % 8)) & 1 ? -s : s;
  });
}

cudaError_t Sign1DecodeFrozen(const float* scales, const uint8_t* bits,
                              size_t n, uint32_t block, AdamArgs adam,
                              bool mask, float* x, float* m, const float* v,
                              cudaStream_t stream) {
  if (block % 4 == 0 && Aligned16(x) && Aligned16(m) && Aligned16(v)) {
    return ForEachElement((n + 3) / 4, stream, [=] __device__(size_t q) {
      if (4 * q + 4 <= n) {
        const float4 c = DecodeQuad(scales, bits, 4 * q, block);
        const float4 vv = reinterpret_cast<const float4*>(v)[q];
        float4 xv = reinterpret_cast<float4*>(x)[q], mv;
        FrozenElement(adam, Masked(mask, vv.x, c.x), &xv.x, &mv.x, vv.x);
        FrozenElement(adam, Masked(mask, vv.y, c.y), &xv.y, &mv.y, vv.y);
        FrozenElement(adam, Masked(mask, vv.z, c.z), &xv.z, &mv.z, vv.z);
        FrozenElement(adam, Masked(mask, vv.w, c.w), &xv.w, &mv.w, vv.w);
        reinterpret_cast<float4*>(x)[q] = xv;
        reinterpret_cast<float4*>(m)[q] = mv;
        return;
      }
      for (size_t j = 4 * q; j < n; ++j) {
        FrozenElement(
            adam,
            Masked(mask, v[j],
                   SignedScale(bits[j / 8], j % 8, scales[BlockOf(j, block)])),
            &x[j], &m[j], v[j]);
      }
    });
  }
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float s = scales[j / block];
    FrozenElement(adam,
                  Masked(mask, v[j], (bits[j / 8] >> (j % 8)) & 1 ? -s : s),
                  &x[j], &m[j], v[j]);
  });
}

}  // namespace morse::kernels::launch
