// The element work of zero_one_adam (design.md 2.7) and onebit_lamb (2.8)
// on the GPU: compress/update_rules.cc's ZeroOne* loops and compress/
// lamb.cc's LambMoments, LambSegmentSums and LambMoveX, the same fp32
// (and, for the layer sums, double) operations in the same order, each an
// explicitly rounded intrinsic.
#include "compress/halving_sum.h"
#include "kernels/element_ops.cuh"
#include "kernels/launch.h"

namespace morse::kernels::launch {
namespace {

using namespace device;

// compress/simd/element_ops.h's LambDirection: u = p + wd*x, p =
// m̂/(sqrt(v̂)+eps) (bounded when frozen); *ratio = d/d' when frozen.
__device__ __forceinline__ float UpdateDirection(const LambArgs& a, float x,
                                                 float m, float v,
                                                 float v_fresh, float* p,
                                                 float* ratio) {
  const Adam& s = a.adam;
  const float m_hat = Div(m, s.bias_correction1);
  const float d = Add(Sqrt(Div(v, s.bias_correction2)), s.eps);
  float q = Div(m_hat, d);
  if (a.frozen) {
    q = BoundRatio(q, s.max_ratio);
    *ratio = Div(d, Add(Sqrt(Div(v_fresh, a.fresh_correction2)), s.eps));
  }
  *p = q;
  return Add(q, Mul(s.weight_decay, x));
}

// compress/halving_sum.h's segment, one thread per element.
constexpr int kSegment = static_cast<int>(compress::kSumSegment);

// compress::LambSegmentSums: a CTA of kSegment threads per segment, the
// terms in shared memory, added by the same halving tree.
__global__ void __launch_bounds__(kSegment)
    LambSegmentsKernel(LambArgs a, const LambSegment* __restrict__ segments,
                       const float* __restrict__ x, const float* __restrict__ m,
                       const float* __restrict__ v,
                       const float* __restrict__ v_fresh,
                       double* __restrict__ out) {
  __shared__ double sa[kSegment], sb[kSegment], sm[kSegment];
  const LambSegment seg = segments[blockIdx.x];
  const int t = threadIdx.x;
  double ta = 0.0, tb = 0.0, tm = 0.0;
  if (static_cast<uint32_t>(t) < seg.len) {
    const size_t j = seg.begin + t;
    float q = 0.0f, ratio = 0.0f;
    const float u =
        UpdateDirection(a, x[j], m[j], v[j], v_fresh[j], &q, &ratio);
    if (a.frozen) {
      ta = __dmul_rn(static_cast<double>(u), static_cast<double>(u));
      tb = __dmul_rn(static_cast<double>(q), static_cast<double>(q));
      tm = ratio > 0.0f ? static_cast<double>(ratio) : 0.0;  // NaN: 0
    } else {
      ta = __dmul_rn(static_cast<double>(x[j]), static_cast<double>(x[j]));
      tb = __dmul_rn(static_cast<double>(u), static_cast<double>(u));
    }
  }
  sa[t] = ta;
  sb[t] = tb;
  sm[t] = tm;
  __syncthreads();
  for (int h = kSegment / 2; h >= 1; h /= 2) {
    if (t < h) {
      sa[t] = __dadd_rn(sa[t], sa[t + h]);
      sb[t] = __dadd_rn(sb[t], sb[t + h]);
      sm[t] = sm[t + h] > sm[t] ? sm[t + h] : sm[t];
    }
    __syncthreads();
  }
  if (t == 0) {
    out[3 * static_cast<size_t>(blockIdx.x)] = sa[0];
    out[3 * static_cast<size_t>(blockIdx.x) + 1] = sb[0];
    out[3 * static_cast<size_t>(blockIdx.x) + 2] = sm[0];
  }
}

// compress::LambMoveX: x = x - step_l * u over each segment, step_l its
// layer's lr * c_l.
__global__ void __launch_bounds__(kSegment)
    LambUpdateXKernel(LambArgs a, const LambSegment* __restrict__ segments,
                      const float* __restrict__ steps, float* __restrict__ x,
                      const float* __restrict__ m,
                      const float* __restrict__ v) {
  const LambSegment seg = segments[blockIdx.x];
  if (threadIdx.x >= seg.len) return;
  const size_t j = seg.begin + threadIdx.x;
  float q, ratio;  // unused here (the CPU passes v' = 0 and no outputs)
  const float u = UpdateDirection(a, x[j], m[j], v[j], 0.0f, &q, &ratio);
  x[j] = Sub(x[j], Mul(steps[seg.layer], u));
}

// compress::SegmentSumOfSquares: a CTA per segment, the same halving tree.
__global__ void __launch_bounds__(kSegment)
    SumOfSquaresKernel(const float* __restrict__ x, size_t n,
                       double* __restrict__ out) {
  __shared__ double t[kSegment];
  const size_t j = static_cast<size_t>(blockIdx.x) * kSegment + threadIdx.x;
  const double value = j < n ? static_cast<double>(x[j]) : 0.0;
  t[threadIdx.x] = __dmul_rn(value, value);
  __syncthreads();
  for (int h = kSegment / 2; h >= 1; h /= 2) {
    if (static_cast<int>(threadIdx.x) < h)
      t[threadIdx.x] = __dadd_rn(t[threadIdx.x], t[threadIdx.x + h]);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = t[0];
}

}  // namespace

cudaError_t SumOfSquaresSegments(const float* x, size_t n, double* out,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SumOfSquaresKernel<<<static_cast<unsigned>((n + kSegment - 1) / kSegment),
                       kSegment, 0, stream>>>(x, n, out);
  return cudaGetLastError();
}

// A clip factor applied (compress::ApplyRule's decoded *= k; the worker's
// own g*k).
cudaError_t Scale(float k, const float* in, float* out, size_t n,
                  cudaStream_t stream) {
  return ForEachElement(n, stream,
                        [=] __device__(size_t j) { out[j] = Mul(in[j], k); });
}

// compress::ZeroOneVarianceStep's element.
cudaError_t ZeroOneVarianceUpdate(AdamArgs s, const float* g, float* x,
                                  float* m, float* v, size_t n,
                                  cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float gj = g[j];
    const float mi = Add(Mul(s.beta1, m[j]), Mul(Sub(1.0f, s.beta1), gj));
    const float vi =
        Add(Mul(s.beta2, v[j]), Mul(Sub(1.0f, s.beta2), Mul(gj, gj)));
    const float m_hat = Div(mi, s.bias_correction1);
    const float v_hat = Div(vi, s.bias_correction2);
    const float d =
        Add(BoundRatio(Div(m_hat, Add(Sqrt(v_hat), s.eps)), s.max_ratio),
            Mul(s.weight_decay, x[j]));
    m[j] = mi;
    v[j] = vi;
    x[j] = Sub(x[j], Mul(s.lr, d));
  });
}

// compress::ZeroOneLocalStep's element.
cudaError_t ZeroOneLocalStep(AdamArgs s, const float* g, float* x, float* m,
                             float* u, const float* v, size_t n, bool write_x,
                             cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float mi = Add(Mul(s.beta1, m[j]), Mul(Sub(1.0f, s.beta1), g[j]));
    const float m_hat = Div(mi, s.bias_correction1);
    const float v_hat = Div(v[j], s.bias_correction2);
    const float d =
        Add(BoundRatio(Div(m_hat, Add(Sqrt(v_hat), s.eps)), s.max_ratio),
            Mul(s.weight_decay, x[j]));
    m[j] = mi;
    u[j] = Add(u[j], Mul(s.lr, d));
    if (write_x) x[j] = Sub(x[j], Mul(s.lr, d));
  });
}

// compress::ZeroOneSyncMessage's element.
cudaError_t ZeroOneSyncMessage(AdamArgs s, float lr_sum, const float* u,
                               const float* m, const float* v, float* out,
                               size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (lr_sum == 0.0f) {  // no local step moved: the message is m
    return cudaMemcpyAsync(out, m, 4 * n, cudaMemcpyDeviceToDevice, stream);
  }
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float a = Add(Sqrt(Div(v[j], s.bias_correction2)), s.eps);
    out[j] = Div(Mul(u[j], a), lr_sum);
  });
}

// compress::ZeroOneSyncStep's element, w masked first (ApplyRule).
cudaError_t ZeroOneSyncUpdate(AdamArgs s, bool mask, const float* w,
                              const float* anchor, float* x, float* m,
                              const float* v, size_t n, cudaStream_t stream) {
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    const float wj = Masked(mask, v[j], w[j]);
    const float a = Add(Sqrt(Div(v[j], s.bias_correction2)), s.eps);
    x[j] = Sub(anchor[j], Mul(s.lr, BoundRatio(Div(wj, a), s.max_ratio)));
    m[j] = wj;
  });
}

// compress::LambMoments' element, the decoded value masked first.
cudaError_t LambMoments(LambArgs a, const float* decoded, float* m, float* v,
                        float* v_fresh, size_t n, cudaStream_t stream) {
  const float b1 = a.adam.beta1, b2 = a.adam.beta2;
  return ForEachElement(n, stream, [=] __device__(size_t j) {
    if (!a.frozen) {
      const float g = Masked(a.mask, v[j], decoded[j]);
      const float vi = Add(Mul(b2, v[j]), Mul(Sub(1.0f, b2), Mul(g, g)));
      m[j] = Add(Mul(b1, m[j]), Mul(Sub(1.0f, b1), g));
      v[j] = vi;
      if (a.copy_fresh) v_fresh[j] = vi;
    } else {
      const float c = Masked(a.mask, v[j], decoded[j]);
      const float g = Div(Sub(c, Mul(b1, m[j])), Sub(1.0f, b1));
      v_fresh[j] = Add(Mul(b2, v_fresh[j]), Mul(Sub(1.0f, b2), Mul(g, g)));
      m[j] = c;
    }
  });
}

cudaError_t LambSegmentSums(LambArgs args, const LambSegment* segments,
                            size_t count, const float* x, const float* m,
                            const float* v, const float* v_fresh, double* out,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  LambSegmentsKernel<<<static_cast<unsigned>(count), kSegment, 0, stream>>>(
      args, segments, x, m, v, v_fresh, out);
  return cudaGetLastError();
}

cudaError_t LambUpdateX(LambArgs args, const LambSegment* segments,
                        size_t count, const float* steps, float* x,
                        const float* m, const float* v, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  LambUpdateXKernel<<<static_cast<unsigned>(count), kSegment, 0, stream>>>(
      args, segments, steps, x, m, v);
  return cudaGetLastError();
}

}  // namespace morse::kernels::launch
