// The compress/ functions a worker runs, on the GPU (DESIGN 2.1-2.4), in
// host-only C++: every pointer is device memory, every function enqueues on
// the context's stream and returns a status. Results are the same bytes and
// floats as compress/ (scalar reference) for the same inputs: the kernels
// use the same fp32 operations in the same order, explicitly rounded, and
// the scale reductions follow compress/'s 16-lane order, so even the scales
// match. Payloads use compress/'s layout (all scales, then packed elements)
// and must start 4-byte aligned.
//
// Not on the GPU: topk (UNIMPLEMENTED), int8-stored error buffers (the
// error buffer here is fp32), averaging (a server's job). Decode functions
// trust their payload: validate it with compress::ValidatePayload on the
// host, where it arrived.
#ifndef MORSE_KERNELS_CODECS_H_
#define MORSE_KERNELS_CODECS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/codec.h"
#include "compress/kernels.h"
#include "compress/lamb.h"
#include "compress/replica.h"
#include "kernels/device.h"

namespace morse::kernels {

// compress::EncodeWithError: payload (PayloadBytes(spec, n) bytes) from x
// (+ error, updated per fb; null when fb is none). Waits for the stream:
// INVALID_ARGUMENT, as compress/ says it, when a block scale is not finite.
// mask_v (n floats, or null): compress::ErrorFeedback::Compress's
// zero-variance mask, fused into sign1 (UNIMPLEMENTED for other codecs).
//
// momentum_m (n floats, or null): x is then a gradient g, and the encoded
// message is 1-bit Adam's local momentum beta1*m + (1-beta1)*g (compress::
// LocalMomentum's floats), fused into the sign1 encode where the block is
// staged; `scratch` (n floats) holds it otherwise.
absl::Status EncodeWithError(Context& ctx, const compress::CodecSpec& spec,
                             const float* x, float* error, size_t n,
                             compress::FeedbackArgs fb,
                             const compress::RoundingKey& key, uint8_t* payload,
                             const float* mask_v = nullptr,
                             const float* momentum_m = nullptr,
                             float beta1 = 0.0f, float* scratch = nullptr);

// EncodeWithError enqueued only, for many partitions in flight: the
// non-finite-scale flag goes to `device_flag` (one device int) and then to
// `host_flag` (pinned) on the stream. Once the stream has reached this
// point, EncodeFlagStatus(spec, *host_flag) is what EncodeWithError returns.
absl::Status EnqueueEncodeWithError(
    Context& ctx, const compress::CodecSpec& spec, const float* x, float* error,
    size_t n, compress::FeedbackArgs fb, const compress::RoundingKey& key,
    uint8_t* payload, int* device_flag, int* host_flag,
    const float* mask_v = nullptr, const float* momentum_m = nullptr,
    float beta1 = 0.0f, float* scratch = nullptr);
absl::Status EncodeFlagStatus(const compress::CodecSpec& spec, int host_flag);

// compress::Decode into out (n floats). Asynchronous.
absl::Status Decode(Context& ctx, const compress::CodecSpec& spec,
                    const uint8_t* payload, size_t n, float* out);

// 1-bit Adam's compression-phase update from a sign1 reply, fused with its
// decode: m = decode(payload), +0 where v is exactly 0 when `mask`;
// x -= lr*(m̂/(sqrt(v̂)+eps) + wd*x) (compress::ApplyRule). Asynchronous.
absl::Status DecodeFrozenUpdate(Context& ctx, const compress::CodecSpec& spec,
                                const uint8_t* payload, size_t n,
                                const compress::AdamScalars& adam, bool mask,
                                float* x, float* m, const float* v);

// The synthetic workload's gradient (worker/workload.h): grad = a*(x - t) +
// noise*(2u - 1), u the Philox draw (seed, step, rank, element index), and
// +0 for j % dead_every == 0 (dead_every 0: none), the same floats as the CPU.
// Returns the loss 0.5*mean(a*(x - t)^2), summed in double in an order that
// differs from the CPU's (it is only reported). Waits for the stream.
absl::StatusOr<double> SyntheticGradient(Context& ctx, uint64_t seed,
                                         int64_t step, uint32_t rank,
                                         float noise, const float* a,
                                         const float* t, const float* x,
                                         float* grad, size_t n,
                                         uint32_t dead_every = 0);

// KernelTable's adam_update, frozen_update and momentum. Asynchronous.
absl::Status AdamUpdate(Context& ctx, const compress::AdamScalars& adam,
                        const float* g, float* x, float* m, float* v, size_t n);
// frozen_update with c masked (+0 where v is 0) when `mask`.
absl::Status FrozenUpdate(Context& ctx, const compress::AdamScalars& adam,
                          bool mask, const float* c, float* x, float* m,
                          const float* v, size_t n);
absl::Status Momentum(Context& ctx, float beta1, const float* m, const float* g,
                      float* out, size_t n);

// Gradient clipping (design.md 2.6). compress::GradientSumOfSquares of n
// device floats: the segments' sums on the GPU into `sums` (device memory)
// and `host` (pinned), ceil(n / compress::kSumSegment) doubles each, added
// on the host in order. Waits for the stream.
absl::StatusOr<double> SumOfSquares(Context& ctx, const float* x, size_t n,
                                    double* sums, double* host);
// out = k * in (out may be in). Asynchronous.
absl::Status Scale(Context& ctx, float k, const float* in, float* out,
                   size_t n);

// zero_one_adam (design.md 2.7), compress/update_rules.h's loops.
// Asynchronous. A variance step's update from the decoded average g:
absl::Status ZeroOneVarianceUpdate(Context& ctx,
                                   const compress::AdamScalars& adam,
                                   const float* g, float* x, float* m, float* v,
                                   size_t n);
// A worker's local step (write_x: not a sync step).
absl::Status ZeroOneLocalStep(Context& ctx, const compress::AdamScalars& adam,
                              const float* g, float* x, float* m, float* u,
                              const float* v, size_t n, bool write_x);
// A worker's sync message into out.
absl::Status ZeroOneSyncMessage(Context& ctx, const compress::AdamScalars& adam,
                                float lr_sum, const float* u, const float* m,
                                const float* v, float* out, size_t n);
// The sync update from the decoded reply w (+0 where v is 0 when `mask`);
// anchor may be x.
absl::Status ZeroOneSyncUpdate(Context& ctx, const compress::AdamScalars& adam,
                               bool mask, const float* w, const float* anchor,
                               float* x, float* m, const float* v, size_t n);

// onebit_lamb (design.md 2.8) for a lamb reply rule (compress::PlanReply).
// compress::ApplyRule's first half: the moments from the decoded reply.
// Asynchronous.
absl::Status LambMoments(Context& ctx, const compress::ReplyRule& rule,
                         const float* decoded, float* m, float* v,
                         float* v_fresh, size_t n);
// A worker's whole model for onebit_lamb's layer rule
// (compress::LayerTotals): the segments of the pieces (compress::LayerPieces
// over [0, D)) in device memory, the buffers their sums go through, and the
// layers' steps.
class LambSegments {
 public:
  static absl::StatusOr<LambSegments> Create(
      absl::Span<const compress::LayerPiece> pieces, size_t layers);
  // compress::PieceStats(SegmentStatsOf(...)) of every piece, kLambStats
  // values each: the segments' sums and each piece's, in the CPU's order,
  // on the GPU (only the pieces' come to the host). Waits for the stream.
  absl::StatusOr<absl::Span<const double>> PieceSums(
      Context& ctx, const compress::ReplyRule& rule, const float* x,
      const float* m, const float* v, const float* v_fresh);
  // compress::MoveLayersX over the whole model with each layer's step
  // (compress::LambLayerSteps). Waits for the stream.
  absl::Status UpdateX(Context& ctx, const compress::ReplyRule& rule,
                       absl::Span<const float> steps, float* x, const float* m,
                       const float* v);

 private:
  size_t count_ = 0, pieces_ = 0, layers_ = 0;
  // The segments, each piece's end among them, their sums and the
  // pieces'; the layers' steps.
  DeviceBuffer segments_, piece_ends_, sums_, piece_sums_, steps_;
  PinnedBuffer host_piece_sums_, host_steps_;
};

}  // namespace morse::kernels

#endif  // MORSE_KERNELS_CODECS_H_
