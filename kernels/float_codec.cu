// fp16 and bf16 (DESIGN 2.3) on the GPU with compress/'s bit-level
// conversions (round to nearest even, compress/'s NaN encodings), and the
// element-wise Adam updates of DESIGN 2.1-2.2.
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

__global__ void SyntheticGradientKernel(uint64_t seed, uint64_t step,
                                        uint32_t rank, float noise,
                                        const float* __restrict__ a,
                                        const float* __restrict__ t,
                                        const float* __restrict__ x,
                                        float* __restrict__ grad, size_t n,
                                        uint32_t dead_every, double* loss) {
  double partial = 0.0;
  MORSE_FOR_EACH_ELEMENT(j, n) {
    const float u = StochasticDraw(seed, step, rank, j);
    const float d = Sub(x[j], t[j]);
    const bool dead = dead_every != 0 && j % dead_every == 0;
    grad[j] =
        dead ? 0.0f : Add(Mul(a[j], d), Mul(noise, Sub(Mul(2.0f, u), 1.0f)));
    partial += 0.5 * static_cast<double>(a[j]) * static_cast<double>(d) *
               static_cast<double>(d);
  }
  for (int offset = 16; offset >= 1; offset /= 2)
    partial += __shfl_down_sync(0xffffffffu, partial, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(loss, partial);
}

}  // namespace

cudaError_t Float16Encode(bool bf16, const float* x, float* e, size_t n,
                          int feedback, float beta, uint16_t* out,
                          cudaStream_t stream) {
  if (feedback == kFbNone) e = nullptr;
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    // With feedback, compress/ encodes u = x + e and decodes it back
    // (EncodeViaDecode).
    const float u = e ? Add(x[j], e[j]) : x[j];
    const uint16_t h = bf16 ? FloatToBfloat16(u) : FloatToHalf(u);
    out[j] = h;
    if (e)
      e[j] = NextError(feedback, beta, e[j], u,
                       bf16 ? Bfloat16ToFloat(h) : HalfToFloat(h));
  });
}

cudaError_t Float16Decode(bool bf16, const uint16_t* in, size_t n, float* out,
                          cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    out[j] = bf16 ? Bfloat16ToFloat(in[j]) : HalfToFloat(in[j]);
  });
}

cudaError_t SyntheticGradient(uint64_t seed, uint64_t step, uint32_t rank,
                              float noise, const float* a, const float* t,
                              const float* x, float* grad, size_t n,
                              uint32_t dead_every, double* loss,
                              cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SyntheticGradientKernel<<<ElementGrid(n), kThreads, 0, stream>>>(
      seed, step, rank, noise, a, t, x, grad, n, dead_every, loss);
  return cudaGetLastError();
}

cudaError_t AdamUpdate(AdamArgs adam, const float* g, float* x, float* m,
                       float* v, size_t n, cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    AdamElement(adam, g[j], &x[j], &m[j], &v[j]);
  });
}

cudaError_t FrozenUpdate(AdamArgs adam, bool mask, const float* c, float* x,
                         float* m, const float* v, size_t n,
                         cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    FrozenElement(adam, Masked(mask, v[j], c[j]), &x[j], &m[j], v[j]);
  });
}

cudaError_t Momentum(float beta1, const float* m, const float* g, float* out,
                     size_t n, cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    out[j] = MomentumElement(beta1, m[j], g[j]);
  });
}

}  // namespace morse::kernels::launch
