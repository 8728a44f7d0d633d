// The per-codec halves of codec.h, one struct per file (sign_codec.cc,
// int_codec.cc, float_codec.cc, topk_codec.cc), each with the same four
// functions; codec.cc dispatches on CodecKind. Internal to compress/: callers
// use codec.h.
//
// Encode: sizes already checked by codec.cc; `error` empty means no feedback.
// Validate: the payload's length was checked; checks its contents.
// Decode / Average: run only on validated payloads.
#ifndef MORSE_COMPRESS_CODEC_PARTS_H_
#define MORSE_COMPRESS_CODEC_PARTS_H_

#include <vector>

#include "compress/codec.h"

namespace morse::compress {

#define MORSE_CODEC_PART(Name)                                                 \
  struct Name {                                                                \
    static absl::Status Encode(const CodecSpec& spec,                          \
                               absl::Span<const float> x,                      \
                               absl::Span<float> error, FeedbackArgs fb,       \
                               const RoundingKey& key,                         \
                               absl::Span<uint8_t> payload);                   \
    static absl::Status Validate(const CodecSpec& spec,                        \
                                 absl::Span<const uint8_t> payload, size_t n); \
    static void Decode(const CodecSpec& spec,                                  \
                       absl::Span<const uint8_t> payload,                      \
                       absl::Span<float> out);                                 \
    static void Average(const CodecSpec& spec,                                 \
                        absl::Span<const absl::Span<const uint8_t>> payloads,  \
                        absl::Span<float> out);                                \
  }

MORSE_CODEC_PART(SignCodec);   // sign1
MORSE_CODEC_PART(IntCodec);    // int8, int4
MORSE_CODEC_PART(FloatCodec);  // fp32, fp16, bf16
MORSE_CODEC_PART(TopKCodec);   // topk

#undef MORSE_CODEC_PART

// SignCodec::Encode with the zero-variance mask fused (mask_v: x.size()
// floats, or null; KernelTable::sign1_encode).
absl::Status EncodeSign1(const CodecSpec& spec, absl::Span<const float> x,
                         absl::Span<float> error, FeedbackArgs fb,
                         absl::Span<uint8_t> payload, const float* mask_v);

// The scales (copied out: payload bytes carry no alignment or type) and the
// packed data of payloads of a scaled codec (sign1, int8, int4), for kernels.
struct ScaledPayloads {
  std::vector<float> scales;  // blocks per payload, payload after payload
  std::vector<const float*> scale_ptrs;
  std::vector<const uint8_t*> data_ptrs;
};
ScaledPayloads SplitScaled(absl::Span<const absl::Span<const uint8_t>> payloads,
                           size_t blocks);

// Reads the little-endian fp32 scale (or value) at byte offset i.
float LoadFloatLE(const uint8_t* p);
void StoreFloatLE(uint8_t* p, float f);

// INVALID_ARGUMENT unless every one of the `count` scales at p is finite and
// not negative.
absl::Status CheckScales(const uint8_t* p, size_t count,
                         absl::string_view codec);

// The generic error-feedback wrapper for codecs without a fused kernel:
// u = x + e, encode u, decode it back as c, e = next error.
absl::Status EncodeViaDecode(
    const CodecSpec& spec, absl::Span<const float> x, absl::Span<float> error,
    FeedbackArgs fb, absl::Span<uint8_t> payload,
    absl::Status (*encode)(const CodecSpec&, absl::Span<const float>,
                           absl::Span<uint8_t>),
    void (*decode)(const CodecSpec&, absl::Span<const uint8_t>,
                   absl::Span<float>));

// out = (sum of decode(payload) in order, from +0) / count: the average for
// codecs without a fused kernel.
void AverageViaDecode(const CodecSpec& spec,
                      absl::Span<const absl::Span<const uint8_t>> payloads,
                      absl::Span<float> out,
                      void (*decode)(const CodecSpec&,
                                     absl::Span<const uint8_t>,
                                     absl::Span<float>));

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_CODEC_PARTS_H_
