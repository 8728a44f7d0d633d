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

// compress/halving_sum.h's segment of kSegment terms, a warp per segment:
// lane l holds terms l, l + 32, l + 64, ... The tree's levels h =
// kSegment/2 .. 32 add terms a lane holds itself (its t[k] and t[k +
// h/32]), the levels 16 .. 1 lane l's sum and lane l + h's: the same pairs
// in the same order as t[i] = t[i] + t[i + h] over the whole segment.
// (A CTA a segment, the tree in shared memory, ran at 0.40 of a device
// copy on an H100: docs/gpu.md.)
constexpr int kSegment = static_cast<int>(compress::kSumSegment);
constexpr int kLanes = 32;
constexpr int kPerLane = kSegment / kLanes;
static_assert(kSegment % kLanes == 0 && (kPerLane & (kPerLane - 1)) == 0);
constexpr int kWarpsPerBlock = 8;  // segments a CTA
constexpr int kBlockThreads = kLanes * kWarpsPerBlock;

unsigned BlocksFor(size_t segments) {
  return static_cast<unsigned>((segments + kWarpsPerBlock - 1) /
                               kWarpsPerBlock);
}

// The segment this thread's warp takes, and its lane.
__device__ __forceinline__ size_t WarpSegment() {
  return static_cast<size_t>(blockIdx.x) * kWarpsPerBlock +
         threadIdx.x / kLanes;
}
__device__ __forceinline__ uint32_t Lane() { return threadIdx.x % kLanes; }

struct AddRn {
  __device__ double operator()(double mine, double other) const {
    return __dadd_rn(mine, other);
  }
};
struct Larger {  // the CPU's: NaN never wins (the terms are >= 0 or 0)
  __device__ double operator()(double mine, double other) const {
    return other > mine ? other : mine;
  }
};

// The tree over a lane's N terms t (see above: the levels from 16N down),
// N = kPerLane, or kPerLane / 2 where the caller took the first level as
// it read the terms; lane 0's result is the segment's. Every lane of the
// warp must call it.
template <int N, typename Op>
__device__ __forceinline__ double WarpHalving(double (&t)[N], Op op) {
  static_assert(N >= 1 && N <= kPerLane && (N & (N - 1)) == 0);
#pragma unroll
  for (int h = N / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int k = 0; k < h; ++k) t[k] = op(t[k], t[k + h]);
  }
  double sum = t[0];
#pragma unroll
  for (int h = kLanes / 2; h >= 1; h /= 2)
    sum = op(sum, __shfl_down_sync(0xffffffffu, sum, h));
  return sum;
}

// Element i of a segment's three terms (0 past its end).
struct LambTerms {
  double a = 0.0, b = 0.0, most = 0.0;
};
__device__ __forceinline__ LambTerms TermsAt(const LambArgs& a,
                                             const LambSegment& seg, uint32_t i,
                                             const float* x, const float* m,
                                             const float* v,
                                             const float* v_fresh) {
  LambTerms t;
  if (i >= seg.len) return t;
  const size_t j = seg.begin + i;
  float q = 0.0f, ratio = 0.0f;
  const float u = UpdateDirection(a, x[j], m[j], v[j], v_fresh[j], &q, &ratio);
  if (a.frozen) {
    t.a = __dmul_rn(static_cast<double>(u), static_cast<double>(u));
    t.b = __dmul_rn(static_cast<double>(q), static_cast<double>(q));
    t.most = ratio > 0.0f ? static_cast<double>(ratio) : 0.0;  // NaN: 0
  } else {
    t.a = __dmul_rn(static_cast<double>(x[j]), static_cast<double>(x[j]));
    t.b = __dmul_rn(static_cast<double>(u), static_cast<double>(u));
  }
  return t;
}

// compress::LambSegmentSums: a warp a segment (WarpHalving). The tree's
// first level (terms k and k + kPerLane/2 of a lane) is taken as the terms
// are read, so that a lane holds half of them at once.
__global__ void __launch_bounds__(kBlockThreads)
    LambSegmentsKernel(LambArgs a, const LambSegment* __restrict__ segments,
                       size_t count, const float* __restrict__ x,
                       const float* __restrict__ m, const float* __restrict__ v,
                       const float* __restrict__ v_fresh,
                       double* __restrict__ out) {
  const size_t s = WarpSegment();
  if (s >= count) return;  // the whole warp
  const LambSegment seg = segments[s];
  const uint32_t lane = Lane();
  constexpr int kHalf = kPerLane / 2;
  double ta[kHalf], tb[kHalf], tm[kHalf];
#pragma unroll
  for (int k = 0; k < kHalf; ++k) {
    const LambTerms lo = TermsAt(a, seg, lane + k * kLanes, x, m, v, v_fresh);
    const LambTerms hi =
        TermsAt(a, seg, lane + (k + kHalf) * kLanes, x, m, v, v_fresh);
    ta[k] = AddRn()(lo.a, hi.a);
    tb[k] = AddRn()(lo.b, hi.b);
    tm[k] = Larger()(lo.most, hi.most);
  }
  const double sa = WarpHalving(ta, AddRn());
  const double sb = WarpHalving(tb, AddRn());
  const double sm = WarpHalving(tm, Larger());
  if (lane == 0) {
    out[3 * s] = sa;
    out[3 * s + 1] = sb;
    out[3 * s + 2] = sm;
  }
}

// compress::PieceStats with onebit_lamb's Add (LambLayers): a thread a
// piece, its segments in order, as the CPU adds them.
__global__ void LambPieceSumsKernel(const double* __restrict__ sums,
                                    const uint32_t* __restrict__ ends,
                                    size_t pieces, double* __restrict__ out) {
  const size_t p = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= pieces) return;
  double a = 0.0, b = 0.0, most = 0.0;
  for (uint32_t s = p == 0 ? 0 : ends[p - 1]; s < ends[p]; ++s) {
    a = AddRn()(a, sums[3 * static_cast<size_t>(s)]);
    b = AddRn()(b, sums[3 * static_cast<size_t>(s) + 1]);
    most = Larger()(most, sums[3 * static_cast<size_t>(s) + 2]);
  }
  out[3 * p] = a;
  out[3 * p + 1] = b;
  out[3 * p + 2] = most;
}

// compress::LambMoveX: x = x - step_l * u over each segment, step_l its
// layer's lr * c_l; a warp a segment.
__global__ void __launch_bounds__(kBlockThreads)
    LambUpdateXKernel(LambArgs a, const LambSegment* __restrict__ segments,
                      size_t count, const float* __restrict__ steps,
                      float* __restrict__ x, const float* __restrict__ m,
                      const float* __restrict__ v) {
  const size_t s = WarpSegment();
  if (s >= count) return;
  const LambSegment seg = segments[s];
  const float step = steps[seg.layer];
  for (uint32_t i = Lane(); i < seg.len; i += kLanes) {
    const size_t j = seg.begin + i;
    float q, ratio;  // unused here (the CPU passes v' = 0 and no outputs)
    const float u = UpdateDirection(a, x[j], m[j], v[j], 0.0f, &q, &ratio);
    x[j] = Sub(x[j], Mul(step, u));
  }
}

// compress::SegmentSumOfSquares: a warp a segment, the same tree.
__global__ void __launch_bounds__(kBlockThreads)
    SumOfSquaresKernel(const float* __restrict__ x, size_t n,
                       double* __restrict__ out) {
  const size_t s = WarpSegment();
  const size_t begin = s * kSegment;
  if (begin >= n) return;
  double t[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const size_t j = begin + Lane() + k * kLanes;
    const double value = j < n ? static_cast<double>(x[j]) : 0.0;
    t[k] = __dmul_rn(value, value);
  }
  const double sum = WarpHalving(t, AddRn());
  if (Lane() == 0) out[s] = sum;
}

}  // namespace

cudaError_t SumOfSquaresSegments(const float* x, size_t n, double* out,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SumOfSquaresKernel<<<BlocksFor((n + kSegment - 1) / kSegment), kBlockThreads,
                       0, stream>>>(x, n, out);
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
  LambSegmentsKernel<<<BlocksFor(count), kBlockThreads, 0, stream>>>(
      args, segments, count, x, m, v, v_fresh, out);
  return cudaGetLastError();
}

cudaError_t LambPieceSums(const double* sums, const uint32_t* ends,
                          size_t pieces, double* out, cudaStream_t stream) {
  if (pieces == 0) return cudaSuccess;
  constexpr unsigned kThreads = 128;
  LambPieceSumsKernel<<<static_cast<unsigned>((pieces + kThreads - 1) /
                                              kThreads),
                        kThreads, 0, stream>>>(sums, ends, pieces, out);
  return cudaGetLastError();
}

cudaError_t LambUpdateX(LambArgs args, const LambSegment* segments,
                        size_t count, const float* steps, float* x,
                        const float* m, const float* v, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  LambUpdateXKernel<<<BlocksFor(count), kBlockThreads, 0, stream>>>(
      args, segments, count, steps, x, m, v);
  return cudaGetLastError();
}

}  // namespace morse::kernels::launch
