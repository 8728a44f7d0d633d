// ShardCore's checkpoints (DESIGN 4): a whole shard at one step, written
// atomically and read back, with the last step's replies for retries.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/optimizer.h"
#include "proto/checkpoint_file.h"
#include "server/partition_state.h"
#include "server/shard_core.h"

namespace morse::server {

absl::Status ShardCore::SaveCheckpoint(const std::string& path) const {
  auto snapshot = Snapshot();
  if (!snapshot.ok()) return snapshot.status();
  return snapshot->Write(path);
}

absl::StatusOr<proto::CheckpointWriter> ShardCore::Snapshot() const {
  // Lock every partition (in order) so the state is one step's, with every
  // completed step's mirror update applied.
  std::vector<std::unique_ptr<MutexLock>> locks;
  for (const auto& p : partitions_) {
    locks.push_back(std::make_unique<MutexLock>(&p->mu));
    ApplyMirror(*p);
  }
  const int64_t step = partitions_.front()->next_step;
  for (const auto& p : partitions_) {
    if (!p->initialized)
      return absl::FailedPreconditionError("the shard has no parameters yet");
    if (p->awaiting_commit) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", p->next_step - 1,
          " waits for the workers' commit (clip_grad_norm's gradient norm "
          "or the optimizer's commit)"));
    }
    if (p->next_step != step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shard is in the middle of step ", std::min(step, p->next_step),
          " (partitions at different steps)"));
    }
  }
  proto::CheckpointWriter writer(
      {"shard", shard_, layout_.fingerprint(),
       compress::AlgorithmFingerprint(job_.algorithm), step});
  writer.AddFloats("x", mirror_.x());
  writer.AddFloats("m", mirror_.m());
  writer.AddFloats("v", mirror_.v());
  std::vector<float> error(range_.size());
  server_error_.Read(0, absl::MakeSpan(error));
  writer.AddFloats("server_error", error);
  // The optimizer's own arrays (onebit_lamb's v' and layer state); every
  // partition is at `step` and holds the same arrays that are not per
  // element.
  for (const compress::NamedState& array :
       StateOf(*partitions_.front(), range_.begin, range_.size())) {
    writer.AddFloats(array.name, array.values);
  }
  // The last completed step's replies and push hashes, so that a worker
  // whose reply was lost when the shard died can still get it by retrying.
  // With each partition's membership (design.md 4, "Membership"): 1 for a
  // rank in it, and 1 for a rank the last reply left out, partition by
  // partition.
  std::string replies;
  std::vector<int64_t> reply_meta, hashes, members, left_out, replaced;
  for (const auto& p : partitions_) {
    // Weights rank 0 changed (ReplaceX) whose pushes are still to show
    // them: the step they must, the step the change followed, x's hash.
    replaced.push_back(p->x_replaced_step);
    replaced.push_back(p->x_replaced_after);
    replaced.push_back(static_cast<int64_t>(p->x_replaced_hash));
    const bool has = p->last_reply != nullptr && step > 0;
    reply_meta.push_back(has ? static_cast<int64_t>(p->last_reply->codec) : -1);
    reply_meta.push_back(
        has ? static_cast<int64_t>(p->last_reply->payload.size()) : 0);
    if (has) replies += p->last_reply->payload;
    for (uint64_t h : p->last_hashes) hashes.push_back(static_cast<int64_t>(h));
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      members.push_back(p->live[r] ? 1 : 0);
      left_out.push_back(has && LeftOut(*p->last_reply, r) ? 1 : 0);
    }
  }
  writer.AddInts("last_reply_meta", reply_meta);
  writer.AddBytes("last_replies", replies);
  // compress::BytesHash's; "last_hashes" (files before it) held std::hash's.
  writer.AddInts("push_hashes", hashes);
  writer.AddInts("members", members);
  writer.AddInts("last_reply_absent", left_out);
  writer.AddInts("x_replaced", replaced);
  return writer;
}

absl::Status ShardCore::RestoreCheckpoint(const std::string& path) {
  auto reader = proto::CheckpointReader::Open(path);
  if (!reader.ok()) return reader.status();
  const proto::CheckpointHeader& h = reader->header();
  if (h.kind != "shard" || h.index != shard_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is the checkpoint of ", h.kind, " ", h.index,
                     ", not of shard ", shard_));
  }
  if (h.layout_fingerprint != layout_.fingerprint() ||
      h.algorithm_fingerprint !=
          compress::AlgorithmFingerprint(job_.algorithm)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " was written by a job with a different ",
        h.layout_fingerprint != layout_.fingerprint()
            ? "layout (dim, shards, block_elems, partition_elems or parameter "
              "groups; an unset partition_elems follows the model's size, "
              "docs/config.md: set the one the checkpoint's job had)"
            : "algorithm (workers, optimizer, hyper-parameters, codecs, "
              "feedback or seed)"));
  }
  const uint64_t n = range_.size();
  auto x = reader->Floats("x", n);
  auto m = reader->Floats("m", n);
  auto v = reader->Floats("v", n);
  auto e = reader->Floats("server_error", n);
  for (const auto* a : {&x, &m, &v, &e}) {
    if (!a->ok()) return a->status();
  }
  if (h.step < 0)
    return absl::DataLossError(absl::StrCat(path, ": negative step"));
  std::vector<compress::NamedState> state;
  for (const compress::StateArray& array :
       compress::OptimizerOf(job_.algorithm).State(job_.algorithm)) {
    auto values =
        reader->Floats(array.name, array.per_element ? n : array.floats);
    if (!values.ok()) return values.status();
    state.push_back({array.name, *std::move(values)});
  }
  if (absl::Status s = compress::CheckState(job_.algorithm, n, state, path);
      !s.ok()) {
    return absl::DataLossError(s.message());
  }
  if (absl::Status s = server_error_.Restore(*e); !s.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", s.message()));
  }
  // The last step's replies and the hashes of the pushes they answered:
  // absent in files from before they were kept, and left out of files whose
  // hashes are std::hash's ("last_hashes", before "push_hashes"); then a
  // retry of that step is refused, as it was.
  const size_t parts = partitions_.size();
  const uint64_t cells = uint64_t{parts} * job_.workers();
  std::vector<std::shared_ptr<const Reply>> last(parts);
  std::vector<int64_t> hashes;
  // The memberships: every rank in when the file has none (before them).
  std::vector<int64_t> members(cells, 1), left_out(cells, 0);
  for (auto [name, into] : {std::pair{"members", &members},
                            std::pair{"last_reply_absent", &left_out}}) {
    if (!reader->Has(name)) continue;
    auto read = reader->Ints(name, cells);
    if (!read.ok()) return read.status();
    *into = *std::move(read);
  }
  // Each partition's replaced x to check (none in files before it).
  std::vector<int64_t> replaced;
  for (size_t i = 0; i < parts; ++i)
    replaced.insert(replaced.end(), {-1, -2, 0});
  if (reader->Has("x_replaced")) {
    auto read = reader->Ints("x_replaced", 3 * parts);
    if (!read.ok()) return read.status();
    replaced = *std::move(read);
  }
  for (size_t i = 0; i < parts; ++i) {
    int64_t in = 0;
    for (uint32_t r = 0; r < job_.workers(); ++r)
      in += members[i * job_.workers() + r] != 0;
    if (in < job_.min_workers) {
      return absl::DataLossError(absl::StrCat(
          path, ": partition ", i, "'s membership has ", in,
          " rank(s), fewer than min_workers (", job_.min_workers, ")"));
    }
  }
  auto replies = reader->Bytes("last_replies");
  if (!replies.ok() && replies.status().code() != absl::StatusCode::kNotFound)
    return replies.status();
  if (replies.ok() && reader->Has("push_hashes")) {
    auto meta = reader->Ints("last_reply_meta", 2 * parts);
    if (!meta.ok()) return meta.status();
    auto read_hashes =
        reader->Ints("push_hashes", uint64_t{parts} * job_.workers());
    if (!read_hashes.ok()) return read_hashes.status();
    hashes = *std::move(read_hashes);
    size_t at = 0;
    for (size_t i = 0; i < parts; ++i) {
      const int64_t codec = (*meta)[2 * i], bytes = (*meta)[2 * i + 1];
      if (codec < 0) continue;
      if (bytes < 0 || static_cast<uint64_t>(bytes) > replies->size() - at ||
          h.step < 1) {
        return absl::DataLossError(
            absl::StrCat(path, ": bad last reply of partition ", i));
      }
      auto reply = std::make_shared<Reply>();
      reply->step = h.step - 1;
      reply->partition = partitions_[i]->partition.id;
      reply->codec = static_cast<compress::CodecKind>(codec);
      reply->payload = replies->substr(at, bytes);
      at += bytes;
      for (uint32_t r = 0; r < job_.workers(); ++r) {
        if (left_out[i * job_.workers() + r] != 0) reply->absent.push_back(r);
      }
      if (reply->codec !=
              compress::PlanStep(job_.algorithm, reply->step).down.kind ||
          reply->payload.size() !=
              compress::SendBytes(
                  compress::PlanSend(job_.algorithm, reply->step,
                                     compress::Direction::kDown,
                                     job_.workers() + shard_,
                                     partitions_[i]->partition.range.begin),
                  partitions_[i]->partition.range.size())) {
        return absl::DataLossError(
            absl::StrCat(path, ": the last reply of partition ", i,
                         " does not fit the job"));
      }
      last[i] = std::move(reply);
    }
  }
  std::copy(x->begin(), x->end(), mirror_.x().begin());
  std::copy(m->begin(), m->end(), mirror_.mutable_m().begin());
  std::copy(v->begin(), v->end(), mirror_.mutable_v().begin());
  MORSE_CHECK(mirror_.RestoreState(range_.begin, n, state).ok());
  const std::vector<std::vector<float>> whole = WholeArrays(job_, state);
  for (size_t i = 0; i < parts; ++i) {
    PartitionState* p = partitions_[i].get();
    MutexLock lock(&p->mu);
    p->initialized = true;
    p->next_step = h.step;
    p->mirror_pending = false;
    p->mirror_moments_applied = false;
    p->awaiting_commit = false;
    p->committed_norm.reset();
    p->committed_max_norm.reset();
    p->last_workers_clip = false;
    p->last_step_restored = true;
    p->committed_values.clear();
    p->committed_amendment.clear();
    p->committed_amendment_hash.reset();
    p->whole_state = whole;
    p->x_replaced_step = replaced[3 * i];
    p->x_replaced_after = replaced[3 * i + 1];
    p->x_replaced_hash = static_cast<uint64_t>(replaced[3 * i + 2]);
    p->last_reply = last[i];
    p->history.clear();
    p->live_count = 0;
    for (uint32_t r = 0; r < job_.workers(); ++r) {
      p->live[r] = members[i * job_.workers() + r] != 0;
      p->live_count += p->live[r] ? 1 : 0;
    }
    for (uint32_t r = 0; r < job_.workers() && !hashes.empty(); ++r) {
      p->last_hashes[r] = static_cast<uint64_t>(hashes[i * job_.workers() + r]);
    }
  }
  MutexLock progress(&progress_mu_);
  initialized_ = static_cast<uint32_t>(partitions_.size());
  observed_step_ = h.step - 1;
  released_step_ = observed_step_;
  unobserved_.clear();
  return absl::OkStatus();
}

}  // namespace morse::server
