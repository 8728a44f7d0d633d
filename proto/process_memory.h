// KeepLargeBuffersMapped: how the daemons ask glibc's malloc to keep their
// large per-step buffers. By default malloc serves every allocation above a
// threshold (128 KiB at first, adapting up to 32 MiB) with its own mmap,
// unmapped again on free, and trims a heap's free top past 128 KiB, so a
// daemon that builds a 4 MiB payload per partition and step (a shard's
// reply, kept for replays and freed steps later; a worker's push) pays a
// page fault and the kernel's zeroing for every 4 KiB of each, every step:
// about a tenth of a shard's fp32 reply burst (tests/bench/shard_pool_bench,
// docs/benchmarks.md). The daemons call this first: buffers up to 32 MiB
// come from malloc's heaps and stay mapped between steps. libmorse calls it
// at a process's first session unless MORSE_MALLOC=default (the process is
// the user's; docs/python.md).
// Header-only, like flags.h.
#ifndef MORSE_PROTO_PROCESS_MEMORY_H_
#define MORSE_PROTO_PROCESS_MEMORY_H_

#include <malloc.h>

namespace morse::proto {

// Returns false where malloc refused a setting (another C library).
inline bool KeepLargeBuffersMapped() {
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest on 64-bit
  constexpr int kTrimThreshold = 512 << 20;
  return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 &&
         mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
}

}  // namespace morse::proto

#endif  // MORSE_PROTO_PROCESS_MEMORY_H_
