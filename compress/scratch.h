// Scratch: per-thread arrays for a step's large temporaries (a decoded
// reply, a shard's average, an encoder's intermediate values). A partition
// is 4 MiB of floats by default; a fresh std::vector of that size is
// mapped, zero-filled and faulted in by the kernel on every call, and
// unmapped after, which on a busy host costs more than the arithmetic.
// Scratch keeps one array per (thread, slot), grown as needed and never
// zeroed: callers overwrite what they read.
//
// A slot is used by one function at a time on a thread: a function that
// holds a slot must not call another that uses the same slot.
#ifndef MORSE_COMPRESS_SCRATCH_H_
#define MORSE_COMPRESS_SCRATCH_H_

#include <cstddef>
#include <memory>

#include "absl/types/span.h"

namespace morse::compress {

enum class ScratchSlot : int {
  kReplyDecoded,    // Replica::ApplyReply
  kLocalScaled,     // a worker's gradient scaled by its clip factor
                    // (LocalMomentum, LocalStep)
  kLocalMomentum,   // EncodeWorkerMessage: one chunk's local momentum, or
                    // a sync message (the host engine's, passed in)
  kShardAverage,    // EncodeShardReply: the average being recompressed (and
                    // server::ShardCore: the decoded reply, for its norm)
  kEncodeInput,     // EncodeViaDecode: u = x + e
  kEncodeDecoded,   // EncodeViaDecode: C(u)
  kAverageDecoded,  // AverageViaDecode: one payload decoded
  kErrorCopy,    // ErrorFeedback: the error of an int8 buffer or a masked range
  kMaskedInput,  // ErrorFeedback::CompressMasked: masked x
  kErrorBackup,  // EncodeShardReply: the partition's error before the step
  kCount,
};

// n floats of this thread's array for `slot`, contents unspecified.
inline absl::Span<float> Scratch(ScratchSlot slot, size_t n) {
  struct Array {
    std::unique_ptr<float[]> data;
    size_t size = 0;
  };
  thread_local Array arrays[static_cast<int>(ScratchSlot::kCount)];
  Array& a = arrays[static_cast<int>(slot)];
  if (a.size < n) {
    a.data.reset(new float[n]);  // uninitialized: the caller writes it
    a.size = n;
  }
  return {a.data.get(), n};
}

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_SCRATCH_H_
