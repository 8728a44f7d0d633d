// Fnv64: 64-bit FNV-1a, the one hash behind Morse's fingerprints (layout,
// algorithm: integers mixed byte by byte, little-endian, so every platform
// agrees) and checksums (replica state, checkpoint files: bulk bytes mixed
// eight at a time, then the tail byte by byte). For comparing and detecting
// corruption, never for security. Values are pinned: changing them breaks
// every peer and checkpoint that compares them.
#ifndef MORSE_COMPRESS_FNV_H_
#define MORSE_COMPRESS_FNV_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace morse::compress {

class Fnv64 {
 public:
  // An integer's 8 bytes, least significant first.
  void MixInt(uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash_ ^= (value >> (8 * byte)) & 0xff;
      hash_ *= kPrime;
    }
  }

  // Bulk bytes: whole 8-byte words, then the remaining bytes one by one.
  void MixWords(const void* data, size_t n) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      hash_ = (hash_ ^ word) * kPrime;
    }
    for (; i < n; ++i) hash_ = (hash_ ^ bytes[i]) * kPrime;
  }

  uint64_t value() const { return hash_; }

 private:
  static constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_FNV_H_
