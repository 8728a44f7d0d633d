#include "compress/codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec_parts.h"
#include "compress/scratch.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {

static_assert(std::endian::native == std::endian::little,
              "the wire encodings are little-endian and so is this code");

namespace {

constexpr struct {
  CodecKind kind;
  absl::string_view name;
} kCodecNames[] = {
    {CodecKind::kFp32, "fp32"}, {CodecKind::kFp16, "fp16"},
    {CodecKind::kBf16, "bf16"}, {CodecKind::kInt8, "int8"},
    {CodecKind::kInt4, "int4"}, {CodecKind::kSign1, "sign1"},
    {CodecKind::kTopK, "topk"},
};

absl::Status CheckLength(const CodecSpec& spec, size_t have, size_t n) {
  const size_t want = PayloadBytes(spec, n);
  if (have == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(CodecName(spec.kind), ": payload of ", have, " bytes for ",
                   n, " elements; the encoding needs exactly ", want));
}

// Calls visit(Part{}) with the struct of codec_parts.h that implements kind.
template <class Visit>
auto VisitPart(CodecKind kind, Visit visit) {
  switch (kind) {
    case CodecKind::kSign1:
      return visit(SignCodec{});
    case CodecKind::kInt8:
    case CodecKind::kInt4:
      return visit(IntCodec{});
    case CodecKind::kTopK:
      return visit(TopKCodec{});
    case CodecKind::kFp32:
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      break;
  }
  return visit(FloatCodec{});
}

absl::Status Validated(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                       size_t n) {
  if (absl::Status s = CheckLength(spec, payload.size(), n); !s.ok()) return s;
  return VisitPart(spec.kind, [&](auto part) {
    return decltype(part)::Validate(spec, payload, n);
  });
}

}  // namespace

FeedbackArgs NormalizeFeedback(FeedbackArgs fb) {
  if (fb.kind == FeedbackKind::kEma && fb.beta == 1.0f)
    fb.kind = FeedbackKind::kEf;
  return fb;
}

absl::string_view CodecName(CodecKind kind) {
  for (const auto& entry : kCodecNames) {
    if (entry.kind == kind) return entry.name;
  }
  return "unknown";
}

absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name) {
  for (const auto& entry : kCodecNames) {
    if (entry.name == name) return entry.kind;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown codec '", name,
      "'; expected one of fp32, fp16, bf16, int8, int4, sign1, topk"));
}

absl::string_view ScaleName(ScaleKind scale) {
  return scale == ScaleKind::kL2 ? "l2" : "l1";
}

absl::StatusOr<ScaleKind> ParseScaleKind(absl::string_view name) {
  if (name == "l2") return ScaleKind::kL2;
  if (name == "l1") return ScaleKind::kL1;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sign1 scale '", name, "'; expected l2 or l1"));
}

absl::Status ValidateCodecSpec(const CodecSpec& spec) {
  if (CodecName(spec.kind) == "unknown") {
    return absl::InvalidArgumentError("unknown codec kind");
  }
  if (spec.block_elems == 0 || spec.block_elems % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_elems must be a positive multiple of 16, got ",
                     spec.block_elems));
  }
  if (spec.kind == CodecKind::kTopK &&
      !(spec.topk_ratio > 0.0 && spec.topk_ratio <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk ratio must be in (0, 1], got ", spec.topk_ratio));
  }
  return absl::OkStatus();
}

size_t BlockCount(const CodecSpec& spec, size_t n) {
  return (n + spec.block_elems - 1) / spec.block_elems;
}

size_t TopKCount(double ratio, size_t n) {
  const double k = std::ceil(ratio * static_cast<double>(n));
  return std::min(n, static_cast<size_t>(k));
}

size_t PayloadBytes(const CodecSpec& spec, size_t n) {
  switch (spec.kind) {
    case CodecKind::kFp32:
      return 4 * n;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return 2 * n;
    case CodecKind::kInt8:
      return 4 * BlockCount(spec, n) + n;
    case CodecKind::kInt4:
      return 4 * BlockCount(spec, n) + (n + 1) / 2;
    case CodecKind::kSign1:
      return 4 * BlockCount(spec, n) + (n + 7) / 8;
    case CodecKind::kTopK:
      return 8 * TopKCount(spec.topk_ratio, n);
  }
  return 0;
}

size_t ElementBytes(CodecKind kind) {
  switch (kind) {
    case CodecKind::kFp32:
      return 4;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return 2;
    default:
      return 0;
  }
}

absl::Status Encode(const CodecSpec& spec, absl::Span<const float> u,
                    const RoundingKey& key, absl::Span<uint8_t> payload) {
  return EncodeWithError(spec, u, {}, FeedbackArgs{}, key, payload);
}

absl::Status EncodeWithError(const CodecSpec& spec, absl::Span<const float> x,
                             absl::Span<float> error, FeedbackArgs fb,
                             const RoundingKey& key,
                             absl::Span<uint8_t> payload,
                             absl::Span<const float> mask_v) {
  if (absl::Status s = ValidateCodecSpec(spec); !s.ok()) return s;
  if (absl::Status s = CheckLength(spec, payload.size(), x.size()); !s.ok())
    return s;
  fb = NormalizeFeedback(fb);
  if (fb.kind == FeedbackKind::kNone) {
    error = {};
  } else if (error.size() != x.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("error buffer of ", error.size(), " elements for ",
                     x.size(), " inputs"));
  }
  if (!mask_v.empty()) {
    if (spec.kind != CodecKind::kSign1) {
      return absl::UnimplementedError(
          absl::StrCat("the zero-variance mask is fused into sign1 only, not ",
                       CodecName(spec.kind)));
    }
    if (mask_v.size() != x.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a mask of ", mask_v.size(), " values for ", x.size(), " inputs"));
    }
    return EncodeSign1(spec, x, error, fb, payload, mask_v.data());
  }
  return VisitPart(spec.kind, [&](auto part) {
    return decltype(part)::Encode(spec, x, error, fb, key, payload);
  });
}

absl::Status ValidatePayload(const CodecSpec& spec,
                             absl::Span<const uint8_t> payload, size_t n) {
  if (absl::Status s = ValidateCodecSpec(spec); !s.ok()) return s;
  return Validated(spec, payload, n);
}

absl::Status Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                    absl::Span<float> out) {
  if (absl::Status s = ValidatePayload(spec, payload, out.size()); !s.ok())
    return s;
  VisitPart(spec.kind,
            [&](auto part) { decltype(part)::Decode(spec, payload, out); });
  return absl::OkStatus();
}

absl::Status DecodeAverage(const CodecSpec& spec,
                           absl::Span<const absl::Span<const uint8_t>> payloads,
                           absl::Span<float> out) {
  if (absl::Status s = ValidateCodecSpec(spec); !s.ok()) return s;
  if (payloads.empty()) {
    return absl::InvalidArgumentError("cannot average zero payloads");
  }
  for (size_t i = 0; i < payloads.size(); ++i) {
    if (absl::Status s = Validated(spec, payloads[i], out.size()); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("payload ", i, ": ", s.message()));
    }
  }
  VisitPart(spec.kind,
            [&](auto part) { decltype(part)::Average(spec, payloads, out); });
  return absl::OkStatus();
}

// --- helpers shared by the codec parts (codec_parts.h) ---

float LoadFloatLE(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

void StoreFloatLE(uint8_t* p, float f) { std::memcpy(p, &f, 4); }

absl::Status CheckScales(const uint8_t* p, size_t count,
                         absl::string_view codec) {
  for (size_t b = 0; b < count; ++b) {
    const float s = LoadFloatLE(p + 4 * b);
    if (!std::isfinite(s) || s < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat(codec, ": scale of block ", b, " is ", s,
                       "; scales must be finite and non-negative"));
    }
  }
  return absl::OkStatus();
}

ScaledPayloads SplitScaled(absl::Span<const absl::Span<const uint8_t>> payloads,
                           size_t blocks) {
  ScaledPayloads split;
  split.scales.resize(payloads.size() * blocks);
  for (size_t i = 0; i < payloads.size(); ++i) {
    if (blocks > 0) {
      std::memcpy(split.scales.data() + i * blocks, payloads[i].data(),
                  4 * blocks);
    }
    split.data_ptrs.push_back(payloads[i].data() + 4 * blocks);
  }
  for (size_t i = 0; i < payloads.size(); ++i) {
    split.scale_ptrs.push_back(split.scales.data() + i * blocks);
  }
  return split;
}

absl::Status EncodeViaDecode(
    const CodecSpec& spec, absl::Span<const float> x, absl::Span<float> error,
    FeedbackArgs fb, absl::Span<uint8_t> payload,
    absl::Status (*encode)(const CodecSpec&, absl::Span<const float>,
                           absl::Span<uint8_t>),
    void (*decode)(const CodecSpec&, absl::Span<const uint8_t>,
                   absl::Span<float>)) {
  const absl::Span<float> u = Scratch(ScratchSlot::kEncodeInput, x.size());
  for (size_t j = 0; j < x.size(); ++j) u[j] = x[j] + error[j];
  if (absl::Status s = encode(spec, u, payload); !s.ok()) return s;
  const absl::Span<float> c = Scratch(ScratchSlot::kEncodeDecoded, x.size());
  decode(spec, payload, c);
  for (size_t j = 0; j < x.size(); ++j)
    error[j] = simd::NextError(fb, error[j], u[j], c[j]);
  return absl::OkStatus();
}

void AverageViaDecode(const CodecSpec& spec,
                      absl::Span<const absl::Span<const uint8_t>> payloads,
                      absl::Span<float> out,
                      void (*decode)(const CodecSpec&,
                                     absl::Span<const uint8_t>,
                                     absl::Span<float>)) {
  const absl::Span<float> decoded =
      Scratch(ScratchSlot::kAverageDecoded, out.size());
  std::fill(out.begin(), out.end(), 0.0f);
  for (const auto& payload : payloads) {
    decode(spec, payload, decoded);
    for (size_t j = 0; j < out.size(); ++j) out[j] += decoded[j];
  }
  const float divisor = static_cast<float>(payloads.size());
  for (float& o : out) o = o / divisor;
}

}  // namespace morse::compress
