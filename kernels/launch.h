// The kernel launchers, for kernels/*.cc (internal to kernels/). Plain C++
// signatures over device pointers; each enqueues on `stream` and returns the
// launch's cudaError_t. Sizes were checked by the caller (codecs.cc).
#ifndef MORSE_KERNELS_LAUNCH_H_
#define MORSE_KERNELS_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace morse::kernels::launch {

struct AdamArgs {  // the fields of compress::AdamScalars, in order
  float lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
      max_ratio;
};

// sign1 of x (+ e) into scales[ceil(n/block)] and bits[ceil(n/8)]; e updated
// per (feedback, beta) unless null. *bad is set to 1 if a scale is not finite.
// mask_v (null: none): DESIGN 2.1's zero-variance mask, u = +0 and the new
// error +0 where mask_v is exactly 0.
// momentum (m non-null): x is a gradient g and the kernel encodes the local
// momentum beta1*m + (1-beta1)*g in the same pass (staged blocks), or writes
// it to `scratch` first (the other blocks).
struct MomentumInput {
  const float* m = nullptr;
  float beta1 = 0;
  float* scratch = nullptr;
};
cudaError_t Sign1Encode(const float* x, float* e, size_t n, uint32_t block,
                        bool l1, int feedback, float beta, const float* mask_v,
                        float* scales, uint8_t* bits, int* bad,
                        cudaStream_t stream, MomentumInput momentum = {});
// out = decode, or (with adam) the 1-bit Adam compression-phase update:
// m = decode (+0 where v is 0 when masking), x -= lr*(m̂/(sqrt(v̂)+eps) + wd*x).
cudaError_t Sign1Decode(const float* scales, const uint8_t* bits, size_t n,
                        uint32_t block, float* out, cudaStream_t stream);
cudaError_t Sign1DecodeFrozen(const float* scales, const uint8_t* bits,
                              size_t n, uint32_t block, AdamArgs adam,
                              bool mask, float* x, float* m, const float* v,
                              cudaStream_t stream);

// int8 (bits 8) or int4 (bits 4) of x (+ e); stochastic rounding when
// `stochastic` with the key (seed, step, rank, first_index).
cudaError_t IntEncode(int bits_per_elem, const float* x, float* e, size_t n,
                      uint32_t block, int feedback, float beta, bool stochastic,
                      uint64_t seed, uint64_t step, uint32_t rank,
                      uint64_t first_index, float* scales, uint8_t* data,
                      int* bad, cudaStream_t stream);
cudaError_t IntDecode(int bits_per_elem, const float* scales,
                      const uint8_t* data, size_t n, uint32_t block, float* out,
                      cudaStream_t stream);

// fp16 (half) or bf16 of x (+ e), as compress's EncodeViaDecode.
cudaError_t Float16Encode(bool bf16, const float* x, float* e, size_t n,
                          int feedback, float beta, uint16_t* out,
                          cudaStream_t stream);
cudaError_t Float16Decode(bool bf16, const uint16_t* in, size_t n, float* out,
                          cudaStream_t stream);

cudaError_t SyntheticGradient(uint64_t seed, uint64_t step, uint32_t rank,
                              float noise, const float* a, const float* t,
                              const float* x, float* grad, size_t n,
                              uint32_t dead_every, double* loss,
                              cudaStream_t stream);

cudaError_t AdamUpdate(AdamArgs adam, const float* g, float* x, float* m,
                       float* v, size_t n, cudaStream_t stream);
cudaError_t FrozenUpdate(AdamArgs adam, bool mask, const float* c, float* x,
                         float* m, const float* v, size_t n,
                         cudaStream_t stream);
cudaError_t Momentum(float beta1, const float* m, const float* g, float* out,
                     size_t n, cudaStream_t stream);

// Gradient clipping (compress::GradientSumOfSquares): out[k] is segment k's
// sum (ceil(n/256) doubles); and out = k * in.
cudaError_t SumOfSquaresSegments(const float* x, size_t n, double* out,
                                 cudaStream_t stream);
cudaError_t Scale(float k, const float* in, float* out, size_t n,
                  cudaStream_t stream);

// zero_one_adam (compress/update_rules.h's ZeroOne* loops).
cudaError_t ZeroOneVarianceUpdate(AdamArgs adam, const float* g, float* x,
                                  float* m, float* v, size_t n,
                                  cudaStream_t stream);
cudaError_t ZeroOneLocalStep(AdamArgs adam, const float* g, float* x, float* m,
                             float* u, const float* v, size_t n, bool write_x,
                             cudaStream_t stream);
cudaError_t ZeroOneSyncMessage(AdamArgs adam, float lr_sum, const float* u,
                               const float* m, const float* v, float* out,
                               size_t n, cudaStream_t stream);
cudaError_t ZeroOneSyncUpdate(AdamArgs adam, bool mask, const float* w,
                              const float* anchor, float* x, float* m,
                              const float* v, size_t n, cudaStream_t stream);

// onebit_lamb (compress/lamb.h): a reply rule's fields, and a segment of
// compress::LayerTotals' order (within one piece of one layer).
struct LambArgs {
  AdamArgs adam;
  float fresh_correction2;
  bool frozen, copy_fresh, mask;
};
struct LambSegment {
  uint64_t begin;  // global element
  uint32_t len;    // <= compress::kLayerSegment
  uint32_t layer;
};
cudaError_t LambMoments(LambArgs args, const float* decoded, float* m, float* v,
                        float* v_fresh, size_t n, cudaStream_t stream);
// out[3k..3k+2]: segment k's two sums and maximum.
cudaError_t LambSegmentSums(LambArgs args, const LambSegment* segments,
                            size_t count, const float* x, const float* m,
                            const float* v, const float* v_fresh, double* out,
                            cudaStream_t stream);
// compress::PieceStats for onebit_lamb's layer rule: out[3p..3p+2] adds
// piece p's segments' sums (segments [ends[p-1], ends[p]) of `sums`) in
// order from 0, and takes their maximum.
cudaError_t LambPieceSums(const double* sums, const uint32_t* ends,
                          size_t pieces, double* out, cudaStream_t stream);
// x -= steps[layer] * u over every segment.
cudaError_t LambUpdateX(LambArgs args, const LambSegment* segments,
                        size_t count, const float* steps, float* x,
                        const float* m, const float* v, cudaStream_t stream);

// The mlp workload's element-wise operations (kernels/mlp.h).
cudaError_t BroadcastRows(const float* bias, size_t rows, size_t cols,
                          float* out, cudaStream_t stream);
cudaError_t Relu(float* z, size_t n, cudaStream_t stream);
cudaError_t ReluBackward(const float* a, float* da, size_t n,
                         cudaStream_t stream);
cudaError_t SoftmaxCrossEntropy(const float* logits, const uint32_t* labels,
                                int rows, int classes, float* dz,
                                double* row_loss, cudaStream_t stream);
cudaError_t ColumnSums(const float* in, int rows, int cols, float* out,
                       cudaStream_t stream);

}  // namespace morse::kernels::launch

#endif  // MORSE_KERNELS_LAUNCH_H_
