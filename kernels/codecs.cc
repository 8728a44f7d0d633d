#include "kernels/codecs.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/launch.h"

namespace morse::kernels {
namespace {

using compress::CodecKind;

cudaStream_t StreamOf(Context& ctx) {
  return static_cast<cudaStream_t>(ctx.stream());
}

launch::AdamArgs Args(const compress::AdamScalars& s) {
  return {s.lr,
          s.beta1,
          s.beta2,
          s.eps,
          s.weight_decay,
          s.bias_correction1,
          s.bias_correction2,
          s.max_ratio};
}

absl::Status CheckSpec(const compress::CodecSpec& spec, const void* payload) {
  if (absl::Status s = compress::ValidateCodecSpec(spec); !s.ok()) return s;
  if (spec.kind == CodecKind::kTopK) {
    return absl::UnimplementedError(
        "topk has no GPU kernel; use a CPU worker for topk jobs");
  }
  if (reinterpret_cast<uintptr_t>(payload) % 4 != 0) {
    return absl::InvalidArgumentError("GPU payloads must start 4-byte aligned");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeWithError(Context& ctx, const compress::CodecSpec& spec,
                             const float* x, float* error, size_t n,
                             compress::FeedbackArgs fb,
                             const compress::RoundingKey& key, uint8_t* payload,
                             const float* mask_v, const float* momentum_m,
                             float beta1, float* scratch) {
  if (absl::Status s = EnqueueEncodeWithError(
          ctx, spec, x, error, n, fb, key, payload, ctx.device_flag(),
          ctx.host_flag(), mask_v, momentum_m, beta1, scratch);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ctx.Synchronize(); !s.ok()) return s;
  return EncodeFlagStatus(spec, *ctx.host_flag());
}

absl::Status EnqueueEncodeWithError(
    Context& ctx, const compress::CodecSpec& spec, const float* x, float* error,
    size_t n, compress::FeedbackArgs fb, const compress::RoundingKey& key,
    uint8_t* payload, int* device_flag, int* host_flag, const float* mask_v,
    const float* momentum_m, float beta1, float* scratch) {
  if (absl::Status s = CheckSpec(spec, payload); !s.ok()) return s;
  if (momentum_m != nullptr && scratch == nullptr && n > 0) {
    return absl::InvalidArgumentError(
        "the fused momentum needs a scratch array");
  }
  if (momentum_m != nullptr && spec.kind != CodecKind::kSign1 && n > 0) {
    // Only sign1 fuses it: form the momentum, then encode it.
    MORSE_CUDA_RETURN_IF_ERROR(
        launch::Momentum(beta1, momentum_m, x, scratch, n, StreamOf(ctx)));
    x = scratch;
    momentum_m = nullptr;
  }
  if (mask_v != nullptr && spec.kind != CodecKind::kSign1) {
    return absl::UnimplementedError(absl::StrCat(
        "the zero-variance mask is fused into sign1 only on the GPU, not ",
        compress::CodecName(spec.kind)));
  }
  fb = compress::NormalizeFeedback(fb);
  if (fb.kind != compress::FeedbackKind::kNone && error == nullptr && n > 0) {
    return absl::InvalidArgumentError("error feedback without an error buffer");
  }
  if (fb.kind == compress::FeedbackKind::kNone) error = nullptr;
  const int feedback = static_cast<int>(fb.kind);
  cudaStream_t stream = StreamOf(ctx);
  switch (spec.kind) {
    case CodecKind::kFp32:
      // fp32 is exact, so feedback has nothing to compensate; no job uses it.
      if (error != nullptr) {
        return absl::UnimplementedError(
            "fp32 with error feedback has no GPU kernel");
      }
      if (n > 0) {
        MORSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            payload, x, 4 * n, cudaMemcpyDeviceToDevice, stream));
      }
      *host_flag = 0;  // no scales to check
      return absl::OkStatus();
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      MORSE_CUDA_RETURN_IF_ERROR(launch::Float16Encode(
          spec.kind == CodecKind::kBf16, x, error, n, feedback, fb.beta,
          reinterpret_cast<uint16_t*>(payload), stream));
      *host_flag = 0;
      return absl::OkStatus();
    default:
      break;
  }
  const size_t blocks = compress::BlockCount(spec, n);
  float* scales = reinterpret_cast<float*>(payload);
  uint8_t* data = payload + 4 * blocks;
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(device_flag, 0, sizeof(int), stream));
  if (spec.kind == CodecKind::kSign1) {
    MORSE_CUDA_RETURN_IF_ERROR(launch::Sign1Encode(
        x, error, n, spec.block_elems, spec.scale == compress::ScaleKind::kL1,
        feedback, fb.beta, mask_v, scales, data, device_flag, stream,
        {momentum_m, beta1, scratch}));
  } else {
    MORSE_CUDA_RETURN_IF_ERROR(launch::IntEncode(
        spec.kind == CodecKind::kInt8 ? 8 : 4, x, error, n, spec.block_elems,
        feedback, fb.beta, spec.rounding == compress::Rounding::kStochastic,
        key.seed, key.step, key.rank, key.first_index, scales, data,
        device_flag, stream));
  }
  MORSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      host_flag, device_flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  return absl::OkStatus();
}

absl::Status EncodeFlagStatus(const compress::CodecSpec& spec, int host_flag) {
  if (host_flag == 0) return absl::OkStatus();
  if (spec.kind == CodecKind::kSign1) {
    return absl::InvalidArgumentError(
        "sign1: a block scale is not finite (the input holds Inf or NaN, or "
        "its squares overflow fp32)");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      compress::CodecName(spec.kind),
      ": the input holds Inf or NaN, so a block scale would not be finite"));
}

absl::Status Decode(Context& ctx, const compress::CodecSpec& spec,
                    const uint8_t* payload, size_t n, float* out) {
  if (absl::Status s = CheckSpec(spec, payload); !s.ok()) return s;
  cudaStream_t stream = StreamOf(ctx);
  const size_t blocks = compress::BlockCount(spec, n);
  const float* scales = reinterpret_cast<const float*>(payload);
  switch (spec.kind) {
    case CodecKind::kFp32:
      if (n > 0) {
        MORSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            out, payload, 4 * n, cudaMemcpyDeviceToDevice, stream));
      }
      return absl::OkStatus();
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      MORSE_CUDA_RETURN_IF_ERROR(launch::Float16Decode(
          spec.kind == CodecKind::kBf16,
          reinterpret_cast<const uint16_t*>(payload), n, out, stream));
      return absl::OkStatus();
    case CodecKind::kSign1:
      MORSE_CUDA_RETURN_IF_ERROR(launch::Sign1Decode(
          scales, payload + 4 * blocks, n, spec.block_elems, out, stream));
      return absl::OkStatus();
    default:
      MORSE_CUDA_RETURN_IF_ERROR(launch::IntDecode(
          spec.kind == CodecKind::kInt8 ? 8 : 4, scales, payload + 4 * blocks,
          n, spec.block_elems, out, stream));
      return absl::OkStatus();
  }
}

absl::Status DecodeFrozenUpdate(Context& ctx, const compress::CodecSpec& spec,
                                const uint8_t* payload, size_t n,
                                const compress::AdamScalars& adam, bool mask,
                                float* x, float* m, const float* v) {
  if (absl::Status s = CheckSpec(spec, payload); !s.ok()) return s;
  if (spec.kind != CodecKind::kSign1) {
    return absl::InvalidArgumentError(
        "DecodeFrozenUpdate takes sign1 payloads");
  }
  const size_t blocks = compress::BlockCount(spec, n);
  MORSE_CUDA_RETURN_IF_ERROR(launch::Sign1DecodeFrozen(
      reinterpret_cast<const float*>(payload), payload + 4 * blocks, n,
      spec.block_elems, Args(adam), mask, x, m, v, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::StatusOr<double> SyntheticGradient(Context& ctx, uint64_t seed,
                                         int64_t step, uint32_t rank,
                                         float noise, const float* a,
                                         const float* t, const float* x,
                                         float* grad, size_t n,
                                         uint32_t dead_every) {
  cudaStream_t stream = StreamOf(ctx);
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(ctx.device_sum(), 0, sizeof(double), stream));
  MORSE_CUDA_RETURN_IF_ERROR(launch::SyntheticGradient(
      seed, static_cast<uint64_t>(step), rank, noise, a, t, x, grad, n,
      dead_every, ctx.device_sum(), stream));
  double host = 0.0;
  MORSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      &host, ctx.device_sum(), sizeof(double), cudaMemcpyDeviceToHost, stream));
  if (absl::Status s = ctx.Synchronize(); !s.ok()) return s;
  return n == 0 ? 0.0 : host / static_cast<double>(n);
}

absl::Status AdamUpdate(Context& ctx, const compress::AdamScalars& adam,
                        const float* g, float* x, float* m, float* v,
                        size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::AdamUpdate(Args(adam), g, x, m, v, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status FrozenUpdate(Context& ctx, const compress::AdamScalars& adam,
                          bool mask, const float* c, float* x, float* m,
                          const float* v, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::FrozenUpdate(Args(adam), mask, c, x, m, v, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status Momentum(Context& ctx, float beta1, const float* m, const float* g,
                      float* out, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::Momentum(beta1, m, g, out, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::StatusOr<double> SumOfSquares(Context& ctx, const float* x, size_t n,
                                    double* sums, double* host) {
  const size_t segments =
      (n + compress::kSumSegment - 1) / compress::kSumSegment;
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::SumOfSquaresSegments(x, n, sums, StreamOf(ctx)));
  if (absl::Status s = ctx.CopyToHost(host, sums, sizeof(double) * segments);
      !s.ok())
    return s;
  if (absl::Status s = ctx.Synchronize(); !s.ok()) return s;
  double sum = 0.0;
  for (size_t k = 0; k < segments; ++k) sum += host[k];
  return sum;
}

absl::Status Scale(Context& ctx, float k, const float* in, float* out,
                   size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::Scale(k, in, out, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status ZeroOneVarianceUpdate(Context& ctx,
                                   const compress::AdamScalars& adam,
                                   const float* g, float* x, float* m, float* v,
                                   size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::ZeroOneVarianceUpdate(Args(adam), g, x, m, v, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status ZeroOneLocalStep(Context& ctx, const compress::AdamScalars& adam,
                              const float* g, float* x, float* m, float* u,
                              const float* v, size_t n, bool write_x) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::ZeroOneLocalStep(
      Args(adam), g, x, m, u, v, n, write_x, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status ZeroOneSyncMessage(Context& ctx, const compress::AdamScalars& adam,
                                float lr_sum, const float* u, const float* m,
                                const float* v, float* out, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::ZeroOneSyncMessage(
      Args(adam), lr_sum, u, m, v, out, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::Status ZeroOneSyncUpdate(Context& ctx, const compress::AdamScalars& adam,
                               bool mask, const float* w, const float* anchor,
                               float* x, float* m, const float* v, size_t n) {
  MORSE_CUDA_RETURN_IF_ERROR(launch::ZeroOneSyncUpdate(
      Args(adam), mask, w, anchor, x, m, v, n, StreamOf(ctx)));
  return absl::OkStatus();
}

namespace {

launch::LambArgs LambArgsOf(const compress::ReplyRule& rule) {
  return {Args(rule.scalars), rule.fresh_correction2, rule.frozen_variance,
          rule.copy_fresh, rule.mask};
}

absl::Status CheckLamb(const compress::ReplyRule& rule) {
  if (!rule.lamb || rule.grad_scale != 1.0f) {
    return absl::InvalidArgumentError(
        "a onebit_lamb kernel for another rule, or one with a clip factor "
        "(scale the decoded reply first: Scale)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LambMoments(Context& ctx, const compress::ReplyRule& rule,
                         const float* decoded, float* m, float* v,
                         float* v_fresh, size_t n) {
  if (absl::Status s = CheckLamb(rule); !s.ok()) return s;
  MORSE_CUDA_RETURN_IF_ERROR(launch::LambMoments(LambArgsOf(rule), decoded, m,
                                                 v, v_fresh, n, StreamOf(ctx)));
  return absl::OkStatus();
}

absl::StatusOr<LambSegments> LambSegments::Create(
    absl::Span<const compress::LayerPiece> pieces, size_t layers) {
  std::vector<launch::LambSegment> table;
  std::vector<uint32_t> ends;
  for (const compress::LayerPiece& piece : pieces) {
    for (uint64_t at = piece.begin; at < piece.end;
         at += compress::kLayerSegment) {
      const uint64_t len =
          std::min<uint64_t>(compress::kLayerSegment, piece.end - at);
      table.push_back({at, static_cast<uint32_t>(len), piece.layer});
    }
    if (table.size() > UINT32_MAX) {
      return absl::InvalidArgumentError(
          "onebit_lamb on the GPU: more than 2^32 - 1 layer segments");
    }
    ends.push_back(static_cast<uint32_t>(table.size()));
  }
  LambSegments out;
  out.count_ = table.size();
  out.pieces_ = pieces.size();
  out.layers_ = layers;
  const auto at_least_one = [](size_t n) { return std::max<size_t>(1, n); };
  const size_t piece_sums_bytes =
      sizeof(double) * compress::kLambStats * at_least_one(pieces.size());
  for (auto [buffer, bytes] :
       {std::pair{&out.segments_,
                  sizeof(launch::LambSegment) * at_least_one(table.size())},
        {&out.piece_ends_, sizeof(uint32_t) * at_least_one(ends.size())},
        {&out.sums_,
         sizeof(double) * compress::kLambStats * at_least_one(table.size())},
        {&out.piece_sums_, piece_sums_bytes},
        {&out.steps_, sizeof(float) * at_least_one(layers)}}) {
    auto allocated = DeviceBuffer::Allocate(bytes);
    if (!allocated.ok()) return allocated.status();
    *buffer = *std::move(allocated);
  }
  for (auto [buffer, bytes] :
       {std::pair{&out.host_piece_sums_, piece_sums_bytes},
        {&out.host_steps_, sizeof(float) * at_least_one(layers)}}) {
    auto allocated = PinnedBuffer::Allocate(bytes);
    if (!allocated.ok()) return allocated.status();
    *buffer = *std::move(allocated);
  }
  if (!table.empty()) {
    if (absl::Status s = out.segments_.Upload(
            table.data(), sizeof(launch::LambSegment) * table.size());
        !s.ok()) {
      return s;
    }
  }
  if (!ends.empty()) {
    if (absl::Status s =
            out.piece_ends_.Upload(ends.data(), sizeof(uint32_t) * ends.size());
        !s.ok()) {
      return s;
    }
  }
  return out;
}

absl::StatusOr<absl::Span<const double>> LambSegments::PieceSums(
    Context& ctx, const compress::ReplyRule& rule, const float* x,
    const float* m, const float* v, const float* v_fresh) {
  if (absl::Status s = CheckLamb(rule); !s.ok()) return s;
  MORSE_CUDA_RETURN_IF_ERROR(launch::LambSegmentSums(
      LambArgsOf(rule), segments_.as<launch::LambSegment>(), count_, x, m, v,
      v_fresh, sums_.as<double>(), StreamOf(ctx)));
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::LambPieceSums(sums_.as<double>(), piece_ends_.as<uint32_t>(),
                            pieces_, piece_sums_.as<double>(), StreamOf(ctx)));
  const size_t bytes = sizeof(double) * compress::kLambStats * pieces_;
  if (absl::Status s =
          ctx.CopyToHost(host_piece_sums_.data(), piece_sums_.data(), bytes);
      !s.ok())
    return s;
  if (absl::Status s = ctx.Synchronize(); !s.ok()) return s;
  return absl::Span<const double>(
      reinterpret_cast<const double*>(host_piece_sums_.data()),
      compress::kLambStats * pieces_);
}

absl::Status LambSegments::UpdateX(Context& ctx,
                                   const compress::ReplyRule& rule,
                                   absl::Span<const float> steps, float* x,
                                   const float* m, const float* v) {
  if (absl::Status s = CheckLamb(rule); !s.ok()) return s;
  if (steps.size() != layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat(steps.size(), " layer steps for ", layers_, " layers"));
  }
  std::copy(steps.begin(), steps.end(),
            reinterpret_cast<float*>(host_steps_.data()));
  if (absl::Status s = ctx.CopyToDevice(steps_.data(), host_steps_.data(),
                                        sizeof(float) * layers_);
      !s.ok()) {
    return s;
  }
  MORSE_CUDA_RETURN_IF_ERROR(
      launch::LambUpdateX(LambArgsOf(rule), segments_.as<launch::LambSegment>(),
                          count_, steps_.as<float>(), x, m, v, StreamOf(ctx)));
  return ctx.Synchronize();
}

}  // namespace morse::kernels
