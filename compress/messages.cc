#include "compress/messages.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/kernels.h"
#include "compress/scratch.h"
#include "compress/sign1_chunks.h"

namespace morse::compress {

namespace {

// An idle partition's payload (SendRule::idle): nothing.
absl::Status EmptyPayload(absl::Span<uint8_t> payload) {
  if (!payload.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a payload of ", payload.size(), " bytes for an idle partition"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeWorkerMessage(const SendRule& rule, const Replica& replica,
                                 ErrorFeedback& error, uint64_t begin,
                                 absl::Span<const float> g, float grad_scale,
                                 absl::Span<uint8_t> payload,
                                 absl::Span<const float> sync_message) {
  const uint64_t n = g.size();
  if (rule.idle) return EmptyPayload(payload);
  const auto mask = [&](uint64_t at, uint64_t len) {
    return rule.mask ? replica.VarianceMask(at, len)
                     : absl::Span<const float>();
  };
  if (rule.accumulated) {  // zero_one_adam's sync: the gradient is already in u
    absl::Span<const float> message = sync_message;
    if (message.empty()) {
      const absl::Span<float> formed = Scratch(ScratchSlot::kLocalMomentum, n);
      replica.SyncMessage(rule.step, rule.sync, begin, formed);
      message = formed;
    } else if (message.size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a sync message of ", message.size(), " floats for ", n));
    }
    return error.Compress(rule.codec, begin, message, rule.key, payload,
                          mask(begin, n));
  }
  if (grad_scale != 1.0f && !rule.local_momentum) {
    return absl::FailedPreconditionError(
        "a worker scales its own gradient only in the compression phase");
  }
  if (!rule.local_momentum) {
    return rule.feedback ? error.Compress(rule.codec, begin, g, rule.key,
                                          payload, mask(begin, n))
                         : Encode(rule.codec, g, rule.key, payload);
  }
  const uint64_t block = rule.codec.block_elems;
  if (rule.codec.kind != CodecKind::kSign1 || !rule.feedback || block == 0) {
    const absl::Span<float> local = Scratch(ScratchSlot::kLocalMomentum, n);
    replica.LocalMomentum(rule.beta1, begin, g, local, grad_scale);
    return rule.feedback ? error.Compress(rule.codec, begin, local, rule.key,
                                          payload, mask(begin, n))
                         : Encode(rule.codec, local, rule.key, payload);
  }
  if (payload.size() != PayloadBytes(rule.codec, n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a payload of ", payload.size(), " bytes for ", n,
                     " elements of ", CodecName(rule.codec.kind)));
  }
  // A chunk of whole blocks encodes into its own small payload, put in its
  // place in the whole one (PutSign1Chunk).
  const uint64_t chunk = ChunkElems(block);
  const absl::Span<float> local =
      Scratch(ScratchSlot::kLocalMomentum, std::min(chunk, n));
  thread_local std::vector<uint8_t> part;
  for (uint64_t at = 0; at < n; at += chunk) {
    const uint64_t len = std::min(chunk, n - at);
    const absl::Span<float> u = local.first(len);
    replica.LocalMomentum(rule.beta1, begin + at, g.subspan(at, len), u,
                          grad_scale);
    part.resize(PayloadBytes(rule.codec, len));
    if (absl::Status s =
            error.Compress(rule.codec, begin + at, u, rule.key,
                           absl::MakeSpan(part), mask(begin + at, len));
        !s.ok()) {
      return s;
    }
    PutSign1Chunk(part.data(), n, block, at, len, payload.data());
  }
  return absl::OkStatus();
}

absl::Status EncodeShardReply(
    const SendRule& rule, const CodecSpec& up,
    absl::Span<const absl::Span<const uint8_t>> pushes, ErrorFeedback& error,
    uint64_t offset, uint64_t n, absl::Span<const float> mask_v,
    absl::Span<uint8_t> payload) {
  if (rule.idle) {
    for (const auto& push : pushes) {
      if (!push.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a push of ", push.size(), " bytes for an idle partition"));
      }
    }
    return EmptyPayload(payload);
  }
  const uint64_t block = rule.codec.block_elems;
  const bool chunked =
      rule.feedback && rule.codec.kind == CodecKind::kSign1 &&
      up.kind == CodecKind::kSign1 && block > 0 && up.block_elems == block &&
      offset % block == 0 &&
      (n % block == 0 ||
       offset + n == error.size()) &&  // RestoreRange's alignment
      error.spec().kind != FeedbackKind::kNone &&
      error.spec().storage == ErrorStorage::kFp32;
  const size_t up_width = ElementBytes(up.kind);
  const size_t down_width = ElementBytes(rule.codec.kind);
  if (!rule.feedback && up_width > 0 && down_width > 0) {
    // fp32/fp16/bf16 both ways, no error (the warmup): a piece of the average
    // at a time, encoded while it is in cache; every element as in the
    // whole-partition average and encode.
    if (payload.size() != PayloadBytes(rule.codec, n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a reply of ", payload.size(), " bytes for ", n, " elements"));
    }
    for (const auto& push : pushes) {
      if (push.size() != PayloadBytes(up, n)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a push of ", push.size(), " bytes for ", n, " elements"));
      }
    }
    constexpr uint64_t kPiece = 16384;
    const absl::Span<float> average =
        Scratch(ScratchSlot::kShardAverage, std::min(kPiece, n));
    thread_local std::vector<absl::Span<const uint8_t>> views;
    views.resize(pushes.size());
    for (uint64_t at = 0; at < n; at += kPiece) {
      const uint64_t len = std::min(kPiece, n - at);
      for (size_t i = 0; i < pushes.size(); ++i)
        views[i] = pushes[i].subspan(up_width * at, up_width * len);
      const absl::Span<float> u = average.first(len);
      if (absl::Status s = DecodeAverage(up, views, u); !s.ok()) return s;
      RoundingKey key = rule.key;
      key.first_index += at;
      if (absl::Status s =
              Encode(rule.codec, u, key,
                     payload.subspan(down_width * at, down_width * len));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  if (!chunked) {
    const absl::Span<float> average = Scratch(ScratchSlot::kShardAverage, n);
    if (absl::Status s = DecodeAverage(up, pushes, average); !s.ok()) return s;
    return rule.feedback ? error.CompressOrKeep(rule.codec, offset, average,
                                                rule.key, payload, mask_v)
                         : Encode(rule.codec, average, rule.key, payload);
  }
  if (payload.size() != PayloadBytes(rule.codec, n) ||
      (!mask_v.empty() && mask_v.size() != n) || offset > error.size() ||
      n > error.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a reply of ", payload.size(), " bytes for ", n, " elements at ",
        offset, " of an error buffer of ", error.size()));
  }
  for (const auto& push : pushes) {
    if (push.size() != PayloadBytes(up, n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a push of ", push.size(), " bytes for ", n, " elements"));
    }
  }
  // A chunk of whole blocks is cut out of each push into a small payload of
  // its own (CutSign1Chunk), averaged, and encoded into another, put in its
  // place in the reply (PutSign1Chunk).
  const uint64_t chunk = ChunkElems(block);
  const absl::Span<float> average =
      Scratch(ScratchSlot::kShardAverage, std::min(chunk, n));
  const absl::Span<float> backup = Scratch(ScratchSlot::kErrorBackup, n);
  thread_local std::vector<std::vector<uint8_t>> parts;
  thread_local std::vector<absl::Span<const uint8_t>> views;
  thread_local std::vector<uint8_t> out;
  if (parts.size() < pushes.size()) parts.resize(pushes.size());
  views.resize(pushes.size());
  for (uint64_t at = 0; at < n; at += chunk) {
    const uint64_t len = std::min(chunk, n - at);
    for (size_t i = 0; i < pushes.size(); ++i) {
      parts[i].resize(PayloadBytes(up, len));
      CutSign1Chunk(pushes[i].data(), n, block, at, len, parts[i].data());
      views[i] = absl::MakeConstSpan(parts[i]);
    }
    const absl::Span<float> u = average.first(len);
    absl::Status status = DecodeAverage(up, views, u);
    error.Read(offset + at,
               backup.subspan(at, len));  // now in cache for Compress too
    out.resize(PayloadBytes(rule.codec, len));
    if (status.ok()) {
      RoundingKey key = rule.key;
      key.first_index += at;
      status =
          error.Compress(rule.codec, offset + at, u, key, absl::MakeSpan(out),
                         mask_v.empty() ? mask_v : mask_v.subspan(at, len));
    }
    if (!status.ok()) {
      MORSE_CHECK(error.RestoreRange(offset, backup.first(at + len)).ok());
      return status;
    }
    PutSign1Chunk(out.data(), n, block, at, len, payload.data());
  }
  return absl::OkStatus();
}

}  // namespace morse::compress
