// Layout: how the flat parameter vector of D fp32 values is cut into blocks,
// shards and partitions (DESIGN 3). A pure function of (D, S, B,
// partition_elems); workers and servers each compute it and compare
// fingerprints before exchanging anything.
//
//   blocks      ceil(D/B) blocks of B elements (the last may be shorter)
//   shards      blocks dealt in contiguous runs, the first (blocks mod S)
//               shards one block longer; shard s owns [begin_s, end_s)
//   segments    the model's parameter groups, each trained with its own lr
//               and weight_decay: `cuts` are the blocks' starts where one
//               ends and the next begins (none: one segment)
//   partitions  each shard range cut from its start, and at each cut inside
//               it, into runs of partition_elems (a run's last may be
//               shorter), so that no partition straddles a segment; ids are
//               global, in order of position
//
// Immutable after Create; safe to share between threads.
#ifndef MORSE_COMPRESS_LAYOUT_H_
#define MORSE_COMPRESS_LAYOUT_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace morse::compress {

struct LayoutSpec {
  uint64_t dim = 0;                     // D
  uint32_t shards = 1;                  // S
  uint32_t block_elems = 2048;          // B, a positive multiple of 16
  uint32_t partition_elems = 1u << 20;  // a positive multiple of B
  // Where segments end: ascending element indices in (0, D), multiples of
  // B (the error buffers keep per-block state); empty for one segment.
  std::vector<uint64_t> cuts;
};

struct Range {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
};

struct Partition {
  uint32_t id = 0;
  uint32_t shard = 0;
  Range range;           // global element indices
  uint32_t segment = 0;  // the segment that holds it (0 without cuts)
};

// The ranks whose pushes a step's average leaves out (membership,
// design.md 4, "Membership"), by partition id, each list ascending; a partition
// past the end or with an empty list: every worker is in.
using Absent = std::vector<std::vector<uint32_t>>;

// One partition's absent ranks are distinct ranks of `workers`, ascending,
// with at least one rank left in.
bool ValidAbsent(const std::vector<uint32_t>& ranks, uint32_t workers);

// The index of the partition that starts at or holds element `element` of
// a valid spec, and the number of partitions, by arithmetic (O(S), no
// Layout built): streaming diloco's fragment of a partition.
uint32_t PartitionIndexAt(const LayoutSpec& spec, uint64_t element);
uint32_t PartitionCount(const LayoutSpec& spec);

// Segment `segment`'s elements (segment < cuts.size() + 1) of a valid spec.
inline Range SegmentRange(const LayoutSpec& spec, uint32_t segment) {
  return Range{segment == 0 ? 0 : spec.cuts[segment - 1],
               segment < spec.cuts.size() ? spec.cuts[segment] : spec.dim};
}

// Calls fn(segment, part) for each segment's part of `range` that is not
// empty, in order: a pass over a range with each segment's elements under
// its own values (a local step's lr and weight_decay, a sync message's
// learning-rate sum), on any replica.
template <typename Fn>
void ForEachSegmentPart(const LayoutSpec& spec, Range range, Fn&& fn) {
  for (uint32_t k = 0; k <= spec.cuts.size(); ++k) {
    const Range segment = SegmentRange(spec, k);
    const Range part{std::max(range.begin, segment.begin),
                     std::min(range.end, segment.end)};
    if (part.begin < part.end) fn(k, part);
  }
}

// The partition size a job gets when its config does not choose one: about
// kDefaultPartitionsPerShard partitions in the largest shard, so that a
// small model's uploads and replies overlap (design.md 3), but never below
// kMinDefaultPartitionElems (per-push costs) nor above
// kMaxDefaultPartitionElems (message size, staging memory); a multiple of
// `block_elems`. With `dim` 0 (not known yet) the largest it can be.
inline constexpr uint32_t kDefaultPartitionsPerShard = 8;
inline constexpr uint32_t kMinDefaultPartitionElems = 1u << 16;
inline constexpr uint32_t kMaxDefaultPartitionElems = 1u << 20;

// The most partitions a layout may cut: each is a push and a reply every
// step, so a job near this is already far too finely cut, and the bound
// keeps a config's layout from asking for gigabytes of partition records.
inline constexpr uint64_t kMaxPartitions = uint64_t{1} << 20;
// The largest model a layout takes (2^50 elements, 4 PiB of fp32): far
// beyond any job, and small enough that no element index overflows.
inline constexpr uint64_t kMaxDim = uint64_t{1} << 50;
uint32_t DefaultPartitionElems(uint64_t dim, uint32_t shards,
                               uint32_t block_elems);

// The block size a job gets when its config does not choose one:
// kDefaultBlockElems, unless the model is too small to give every shard a
// block of that size (a LoRA adapter, a toy model on several shards; such a
// layout was refused); then the largest power of two, at least 16, that
// gives every shard a block where the model allows it. With `dim` 0 (not
// known yet) kDefaultBlockElems.
uint32_t DefaultBlockElems(uint64_t dim, uint32_t shards);

class Layout {
 public:
  // INVALID_ARGUMENT for D = 0 or above kMaxDim, S = 0, more shards than
  // blocks, block and partition sizes that break the rules above, cuts out of
  // order, off a block or outside (0, D), or more than kMaxPartitions
  // partitions.
  static absl::StatusOr<Layout> Create(const LayoutSpec& spec);

  const LayoutSpec& spec() const { return spec_; }
  uint64_t block_count() const { return block_count_; }
  const Range& shard_range(uint32_t shard) const { return shards_[shard]; }
  absl::Span<const Partition> partitions() const { return partitions_; }
  uint32_t segment_count() const {
    return static_cast<uint32_t>(spec_.cuts.size()) + 1;
  }
  // The partitions of one shard, in order.
  absl::Span<const Partition> shard_partitions(uint32_t shard) const;
  // 64-bit FNV-1a over a version tag and the four spec fields, then the
  // cuts when there are any, little-endian: equal specs give equal
  // fingerprints on every platform.
  uint64_t fingerprint() const { return fingerprint_; }

 private:
  Layout() = default;

  LayoutSpec spec_;
  uint64_t block_count_ = 0;
  std::vector<Range> shards_;
  std::vector<Partition> partitions_;
  std::vector<uint32_t> first_partition_;  // per shard, plus one past the end
  uint64_t fingerprint_ = 0;
};

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_LAYOUT_H_
