// The messages of a step (DESIGN 2.1-2.4): what a worker pushes and what a
// shard replies, encoded by the rule PlanSend gives each direction. The
// one place every sender forms its message: CPU workers' host engine,
// shards, the simulator (a GPU worker's kernels have twins of their own).
#ifndef MORSE_COMPRESS_MESSAGES_H_
#define MORSE_COMPRESS_MESSAGES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/replica.h"
#include "compress/step_plan.h"

namespace morse::compress {

// A shard's reply for `n` elements at `offset` in its error buffer (PlanSend
// of the down direction): the average of the workers' `pushes` (codec `up`,
// validated, in rank order) encoded with `rule`'s codec, through `error`
// when the rule has feedback, masked where mask_v is 0. On any error the
// error buffer is exactly as it was (DESIGN 4). With sign1 both ways and
// an fp32 error buffer the average is formed and recompressed a cache-sized
// chunk of blocks at a time, so it never goes to memory; the bits are those
// of averaging the whole partition first (tests/compress). The shards and
// the simulator both call this.
absl::Status EncodeShardReply(
    const SendRule& rule, const CodecSpec& up,
    absl::Span<const absl::Span<const uint8_t>> pushes, ErrorFeedback& error,
    uint64_t offset, uint64_t n, absl::Span<const float> mask_v,
    absl::Span<uint8_t> payload);

// A worker's message for [begin, begin + g.size()) of step `rule` (PlanSend
// of the up direction): the local momentum of g (scaled by `grad_scale`,
// ClipsLocally) when the rule says so, through `error` when it has
// feedback, masked where v is 0 when it masks, encoded into `payload`
// (PayloadBytes of the range). With sign1 (block-local) and local momentum,
// the momentum is formed and encoded a cache-sized chunk of blocks at a
// time, so it never goes to memory: one pass over g, m and e instead of
// two. The bits are those of forming it whole first (tests/compress).
// zero_one_adam's sync (rule.accumulated) encodes `sync_message` where the
// caller already has it (Replica::LocalStepRange with the rule's sync
// scalars), else the replica's SyncMessage.
absl::Status EncodeWorkerMessage(const SendRule& rule, const Replica& replica,
                                 ErrorFeedback& error, uint64_t begin,
                                 absl::Span<const float> g, float grad_scale,
                                 absl::Span<uint8_t> payload,
                                 absl::Span<const float> sync_message = {});

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_MESSAGES_H_
