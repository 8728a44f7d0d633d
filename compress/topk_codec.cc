// topk (DESIGN 2.3): the k = ceil(ratio * n) largest |u_j| (ties to the lower
// index) as k uint32 indices ascending, then their k fp32 values.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec_parts.h"
#include "compress/simd/element_ops.h"

namespace morse::compress {
namespace {

uint32_t LoadIndex(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

absl::Status EncodeTopK(const CodecSpec& spec, absl::Span<const float> u,
                        absl::Span<uint8_t> payload) {
  const size_t n = u.size();
  const size_t k = TopKCount(spec.topk_ratio, n);
  for (size_t j = 0; j < n; ++j) {
    if (!std::isfinite(u[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat("topk: input element ", j, " is not finite"));
    }
  }
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  const auto larger = [&](uint32_t a, uint32_t b) {
    const float fa = std::fabs(u[a]), fb = std::fabs(u[b]);
    return fa != fb ? fa > fb : a < b;
  };
  if (k < n)
    std::nth_element(order.begin(), order.begin() + k, order.end(), larger);
  order.resize(k);
  std::sort(order.begin(), order.end());
  uint8_t* indices = payload.data();
  uint8_t* values = payload.data() + 4 * k;
  for (size_t i = 0; i < k; ++i) {
    std::memcpy(indices + 4 * i, &order[i], 4);
    std::memcpy(values + 4 * i, &u[order[i]], 4);
  }
  return absl::OkStatus();
}

void DecodeTopK(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                absl::Span<float> out) {
  const size_t k = TopKCount(spec.topk_ratio, out.size());
  std::fill(out.begin(), out.end(), 0.0f);
  for (size_t i = 0; i < k; ++i) {
    out[LoadIndex(payload.data() + 4 * i)] =
        LoadFloatLE(payload.data() + 4 * (k + i));
  }
}

}  // namespace

absl::Status TopKCodec::Encode(const CodecSpec& spec, absl::Span<const float> x,
                               absl::Span<float> error, FeedbackArgs fb,
                               const RoundingKey&,
                               absl::Span<uint8_t> payload) {
  if (error.empty()) return EncodeTopK(spec, x, payload);
  return EncodeViaDecode(spec, x, error, fb, payload, EncodeTopK, DecodeTopK);
}

absl::Status TopKCodec::Validate(const CodecSpec& spec,
                                 absl::Span<const uint8_t> payload, size_t n) {
  const size_t k = TopKCount(spec.topk_ratio, n);
  for (size_t i = 0; i < k; ++i) {
    const uint32_t index = LoadIndex(payload.data() + 4 * i);
    if (index >= n ||
        (i > 0 && index <= LoadIndex(payload.data() + 4 * (i - 1)))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "topk: index ", i, " (", index,
          ") is out of range or not strictly ascending for ", n, " elements"));
    }
    if (!std::isfinite(LoadFloatLE(payload.data() + 4 * (k + i)))) {
      return absl::InvalidArgumentError(
          absl::StrCat("topk: value ", i, " is not finite"));
    }
  }
  return absl::OkStatus();
}

void TopKCodec::Decode(const CodecSpec& spec, absl::Span<const uint8_t> payload,
                       absl::Span<float> out) {
  DecodeTopK(spec, payload, out);
}

void TopKCodec::Average(const CodecSpec& spec,
                        absl::Span<const absl::Span<const uint8_t>> payloads,
                        absl::Span<float> out) {
  AverageViaDecode(spec, payloads, out, DecodeTopK);
}

}  // namespace morse::compress
