// BytesHash: a 64-bit hash of bulk bytes at memory speed, for telling a
// payload from another (a re-sent push from the one a shard answered, a
// replayed reply from the one a worker had). Four independent lanes of
// eight-byte words (multiply, rotate), merged and finished like Fnv64's
// tail, so a 4 MB payload costs a read and little else (std::hash's byte
// loop cost a shard more than averaging the pushes). Words are read as
// Morse's little-endian hosts hold them; values are pinned (shard
// checkpoints keep them). For comparing, never for security.
#ifndef MORSE_COMPRESS_BYTES_HASH_H_
#define MORSE_COMPRESS_BYTES_HASH_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace morse::compress {

inline uint64_t BytesHashMix(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * 0x9e3779b97f4a7c15ull;  // odd: a bijection
  return (lane << 29) | (lane >> 35);
}

inline uint64_t BytesHashWord(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

inline uint64_t BytesHash(const void* data, size_t n) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  uint64_t a = 0x243f6a8885a308d3ull, b = 0x13198a2e03707344ull,
           c = 0xa4093822299f31d0ull, d = 0x082efa98ec4e6c89ull;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = BytesHashMix(a, BytesHashWord(bytes + i));
    b = BytesHashMix(b, BytesHashWord(bytes + i + 8));
    c = BytesHashMix(c, BytesHashWord(bytes + i + 16));
    d = BytesHashMix(d, BytesHashWord(bytes + i + 24));
  }
  uint64_t hash = n * 0x9e3779b97f4a7c15ull;
  for (uint64_t lane : {a, b, c, d}) hash = BytesHashMix(hash, lane);
  for (; i < n; ++i) hash = BytesHashMix(hash, bytes[i]);
  hash ^= hash >> 31;  // every input bit reaches the low bits too
  return hash * 0x9e3779b97f4a7c15ull;
}

inline uint64_t BytesHash(absl::string_view bytes) {
  return BytesHash(bytes.data(), bytes.size());
}

// The hash of a partition's parameters (PushRequest.x_hash,
// PartitionState.x_hash): what a worker and a shard compare to tell
// whether they hold the same x.
inline uint64_t XHash(absl::Span<const float> x) {
  return BytesHash(x.data(), x.size() * sizeof(float));
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_BYTES_HASH_H_
