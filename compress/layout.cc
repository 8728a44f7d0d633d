#include "compress/layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/fnv.h"

namespace morse::compress {
namespace {

constexpr uint64_t kLayoutVersion = 1;

// The blocks dealt to shard s of `shards`: the first (blocks mod S) shards
// hold one more than the rest, so shard 0 is the longest.
uint64_t BlocksOfShard(uint64_t blocks, uint32_t shards, uint32_t s) {
  return blocks / shards + (s < blocks % shards ? 1 : 0);
}

// Cuts shard range `r` at each of spec.cuts inside it and each piece into
// runs of partition_elems, calling fn(run, segment) for them in order until
// fn returns false.
template <class Fn>
void CutShard(const LayoutSpec& spec, Range r, Fn fn) {
  auto cut = std::upper_bound(spec.cuts.begin(), spec.cuts.end(), r.begin);
  uint32_t segment = static_cast<uint32_t>(cut - spec.cuts.begin());
  for (uint64_t begin = r.begin; begin < r.end;) {
    const uint64_t end = cut != spec.cuts.end() && *cut < r.end ? *cut : r.end;
    for (uint64_t at = begin; at < end; at += spec.partition_elems) {
      if (!fn(Range{at, std::min(end, at + spec.partition_elems)}, segment))
        return;
    }
    begin = end;
    if (cut != spec.cuts.end() && *cut == end) {
      ++cut;
      ++segment;
    }
  }
}

// How many runs CutShard makes of shard range `r`, by arithmetic over the
// cuts inside it (O(log cuts + cuts inside)).
uint64_t RunsOfShard(const LayoutSpec& spec, Range r) {
  auto runs_of = [&spec](uint64_t n) {
    return n / spec.partition_elems + (n % spec.partition_elems != 0 ? 1 : 0);
  };
  uint64_t runs = 0;
  uint64_t begin = r.begin;
  for (auto cut = std::upper_bound(spec.cuts.begin(), spec.cuts.end(), r.begin);
       cut != spec.cuts.end() && *cut < r.end; ++cut) {
    runs += runs_of(*cut - begin);
    begin = *cut;
  }
  return runs + runs_of(r.end - begin);
}

}  // namespace

uint32_t PartitionIndexAt(const LayoutSpec& spec, uint64_t element) {
  const uint64_t blocks = (spec.dim + spec.block_elems - 1) / spec.block_elems;
  uint64_t index = 0, block = 0;
  for (uint32_t s = 0; s < spec.shards; ++s) {
    const uint64_t begin = block * spec.block_elems;
    block += BlocksOfShard(blocks, spec.shards, s);
    const uint64_t end = std::min(spec.dim, block * spec.block_elems);
    if (element >= end && s + 1 < spec.shards) {  // a shard before its own
      index += RunsOfShard(spec, Range{begin, end});
      continue;
    }
    if (spec.cuts.empty()) {
      return static_cast<uint32_t>(index +
                                   (element - begin) / spec.partition_elems);
    }
    // With cuts, the holding shard's runs up to the element one by one.
    CutShard(spec, Range{begin, end}, [&](const Range& run, uint32_t) {
      if (element < run.end) return false;
      ++index;
      return true;
    });
    return static_cast<uint32_t>(index);
  }
  return static_cast<uint32_t>(index);
}

uint32_t PartitionCount(const LayoutSpec& spec) {
  return PartitionIndexAt(spec, spec.dim - 1) + 1;
}

uint32_t DefaultPartitionElems(uint64_t dim, uint32_t shards,
                               uint32_t block_elems) {
  const uint64_t b = std::max<uint32_t>(block_elems, 1);
  auto whole_blocks = [b](uint64_t n) { return (n + b - 1) / b * b; };
  const uint64_t lo = whole_blocks(kMinDefaultPartitionElems);
  const uint64_t hi = whole_blocks(kMaxDefaultPartitionElems);
  if (dim == 0 || shards == 0) return static_cast<uint32_t>(hi);
  const uint64_t largest_shard =
      BlocksOfShard((dim + b - 1) / b, shards, 0) * b;
  const uint64_t wanted =
      whole_blocks((largest_shard + kDefaultPartitionsPerShard - 1) /
                   kDefaultPartitionsPerShard);
  return static_cast<uint32_t>(std::clamp(wanted, lo, hi));
}

uint32_t DefaultBlockElems(uint64_t dim, uint32_t shards) {
  auto blocks = [dim](uint64_t block) { return (dim + block - 1) / block; };
  uint32_t block = kDefaultBlockElems;
  if (dim == 0) return block;
  while (block > 16 && blocks(block) < shards) block /= 2;
  return block;
}

absl::StatusOr<Layout> Layout::Create(const LayoutSpec& spec) {
  if (spec.dim == 0 || spec.dim > kMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: dim must be in [1, 2^50], got ", spec.dim));
  }
  if (spec.shards == 0)
    return absl::InvalidArgumentError("layout: shards must be positive");
  if (spec.block_elems == 0 || spec.block_elems % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: block_elems must be a positive multiple of 16, got ",
        spec.block_elems));
  }
  if (spec.partition_elems == 0 ||
      spec.partition_elems % spec.block_elems != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: partition_elems (", spec.partition_elems,
                     ") must be a positive multiple of block_elems (",
                     spec.block_elems, ")"));
  }
  for (size_t i = 0; i < spec.cuts.size(); ++i) {
    if (spec.cuts[i] == 0 || spec.cuts[i] >= spec.dim ||
        spec.cuts[i] % spec.block_elems != 0 ||
        (i > 0 && spec.cuts[i] <= spec.cuts[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout: cut ", i, " at element ", spec.cuts[i],
                       " is not ascending inside (0, ", spec.dim,
                       ") on a block of ", spec.block_elems,
                       " elements (pad each parameter group to whole "
                       "blocks)"));
    }
  }
  Layout layout;
  layout.spec_ = spec;
  layout.block_count_ =
      spec.dim / spec.block_elems + (spec.dim % spec.block_elems != 0 ? 1 : 0);
  if (spec.shards > layout.block_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: ", spec.shards, " shards but only ",
                     layout.block_count_, " blocks of ", spec.block_elems,
                     " elements; every shard needs a block"));
  }
  uint64_t block = 0;
  for (uint32_t s = 0; s < spec.shards; ++s) {
    const uint64_t blocks = BlocksOfShard(layout.block_count_, spec.shards, s);
    layout.shards_.push_back(
        Range{block * spec.block_elems,
              std::min(spec.dim, (block + blocks) * spec.block_elems)});
    block += blocks;
  }
  uint64_t partitions = 0;
  for (const Range& range : layout.shards_)
    partitions += RunsOfShard(spec, range);
  if (partitions > kMaxPartitions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: ", spec.dim, " elements in partitions of ",
        spec.partition_elems, " make ", partitions, " partitions, more than ",
        kMaxPartitions, "; raise partition_elems"));
  }
  layout.partitions_.reserve(partitions);
  for (uint32_t s = 0; s < spec.shards; ++s) {
    const Range range = layout.shards_[s];
    layout.first_partition_.push_back(
        static_cast<uint32_t>(layout.partitions_.size()));
    CutShard(spec, range, [&](const Range& run, uint32_t segment) {
      layout.partitions_.push_back(Partition{
          static_cast<uint32_t>(layout.partitions_.size()), s, run, segment});
      return true;
    });
  }
  layout.first_partition_.push_back(
      static_cast<uint32_t>(layout.partitions_.size()));
  Fnv64 hash;
  for (uint64_t v :
       {kLayoutVersion, spec.dim, uint64_t{spec.shards},
        uint64_t{spec.block_elems}, uint64_t{spec.partition_elems}}) {
    hash.MixInt(v);
  }
  if (!spec.cuts.empty()) {  // a layout without cuts keeps its fingerprint
    hash.MixInt(spec.cuts.size());
    for (uint64_t cut : spec.cuts) hash.MixInt(cut);
  }
  layout.fingerprint_ = hash.value();
  return layout;
}

absl::Span<const Partition> Layout::shard_partitions(uint32_t shard) const {
  return absl::MakeConstSpan(partitions_)
      .subspan(first_partition_[shard],
               first_partition_[shard + 1] - first_partition_[shard]);
}

bool ValidAbsent(const std::vector<uint32_t>& ranks, uint32_t workers) {
  return std::is_sorted(ranks.begin(), ranks.end()) &&
         std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end() &&
         (ranks.empty() || ranks.back() < workers) && ranks.size() < workers;
}

}  // namespace morse::compress
