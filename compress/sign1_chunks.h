// The sign1 payload's chunks (design.md 2.3), shared by the reply update
// (replica.cc) and the encoders (messages.cc). Internal to compress/.
#ifndef MORSE_COMPRESS_SIGN1_CHUNKS_H_
#define MORSE_COMPRESS_SIGN1_CHUNKS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace morse::compress {

// Whole blocks of about 32K elements (128 KiB of floats): what the chunked
// sign1 encode and reply update keep in L2 between their two halves.
inline uint64_t ChunkElems(uint64_t block) {
  constexpr uint64_t kTarget = uint64_t{1} << 15;
  return block * std::max<uint64_t>(1, kTarget / block);
}

// A sign1 payload of n elements holds every block's scale, then the bits
// (design.md 2.3), so a chunk of whole blocks (len elements from element
// `at`; block_elems is a multiple of 16, so its bits start on a byte) lies
// in two places. CutSign1Chunk copies it out into a payload of its own
// (PayloadBytes of len), PutSign1Chunk copies such a payload back in.
inline void CutSign1Chunk(const uint8_t* whole, uint64_t n, uint64_t block,
                          uint64_t at, uint64_t len, uint8_t* part) {
  const uint64_t blocks = (n + block - 1) / block,
                 part_blocks = (len + block - 1) / block;
  std::memcpy(part, whole + 4 * (at / block), 4 * part_blocks);
  std::memcpy(part + 4 * part_blocks, whole + 4 * blocks + at / 8,
              (len + 7) / 8);
}

inline void PutSign1Chunk(const uint8_t* part, uint64_t n, uint64_t block,
                          uint64_t at, uint64_t len, uint8_t* whole) {
  const uint64_t blocks = (n + block - 1) / block,
                 part_blocks = (len + block - 1) / block;
  std::memcpy(whole + 4 * (at / block), part, 4 * part_blocks);
  std::memcpy(whole + 4 * blocks + at / 8, part + 4 * part_blocks,
              (len + 7) / 8);
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_SIGN1_CHUNKS_H_
