#include "server/handler.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace morse::server {
namespace {

// A clip of part of the model from its wire form (morse.proto
// CommitRequest.clip_piece_ends): INVALID_ARGUMENT unless there are as many
// ends as scales. The shard validates the rest (CheckCommit).
template <typename Ends, typename Scales>
absl::StatusOr<compress::ClipPieces> ClipPiecesFromWire(const Ends& ends,
                                                        const Scales& scales) {
  if (ends.size() != scales.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a clip of ", ends.size(), " piece end(s) and ",
                     scales.size(), " scale(s); as many of each"));
  }
  compress::ClipPieces pieces(ends.size());
  for (int i = 0; i < ends.size(); ++i) pieces[i] = {ends[i], scales[i]};
  return pieces;
}

std::string Bytes(const std::vector<float>& a) {
  return std::string(reinterpret_cast<const char*>(a.data()), 4 * a.size());
}

// Whether every byte of a (non-empty) array is zero: +0.0 everywhere, not
// -0.0, so a receiver that fills +0.0 gets the same bits.
bool AllZeroBits(const std::vector<float>& a) {
  if (a.empty()) return false;
  uint32_t any = 0;
  for (const float f : a) any |= absl::bit_cast<uint32_t>(f);
  return any == 0;
}

// One of FetchPartition's arrays: left out and flagged when it is all zero.
void SetArray(const std::vector<float>& a, std::string* bytes, bool* zero) {
  *zero = AllZeroBits(a);
  if (!*zero) *bytes = Bytes(a);
}

}  // namespace

absl::StatusOr<std::shared_ptr<ShardCore>> ShardHandler::Core() const {
  std::shared_ptr<ShardCore> core = host_->core();
  if (core != nullptr) return core;
  // An external job's shard that restarted: the workers Join again.
  absl::Status status = absl::UnavailableError(
      "the model's size is not known yet: no worker has joined");
  proto::SetTrailer(status, proto::kNeedsJoinKey, "1");
  return status;
}

absl::Status ShardHandler::Join(const v1::JoinRequest& request,
                                v1::JoinReply* reply) {
  auto job = proto::ParseJobConfigProto(request.job().SerializeAsString());
  absl::Status status =
      job.ok() ? host_->Join(request.rank(), *job) : job.status();
  reply->set_workers_joined(host_->workers_joined());
  reply->set_workers(host_->base().workers());
  if (status.ok() && job->external.generation != host_->generation()) {
    // Taken for the next layout, which the others have yet to join.
    reply->set_layout_fingerprint(
        compress::Layout::Create(job->algorithm.layout)->fingerprint());
  } else if (std::shared_ptr<ShardCore> core = host_->core()) {
    reply->set_layout_fingerprint(core->layout().fingerprint());
  }
  return status;
}

absl::Status ShardHandler::InitPartition(
    const v1::InitPartitionRequest& request, v1::InitPartitionReply* reply) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return core.status();
  absl::Status status =
      (*core)->InitPartition(request.rank(), request.partition(),
                             request.layout_fingerprint(), request.values());
  const ShardStatus s = (*core)->Status();
  reply->set_partitions_initialized(s.partitions_initialized);
  reply->set_partitions_total(s.partitions);
  return status;
}

void ShardHandler::Push(v1::PushRequest& request, PushDone done) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return done(core.status());
  auto codec = proto::FromWire(request.codec());
  if (!codec.ok()) return done(codec.status());
  if (request.has_lr() != request.has_weight_decay()) {
    return done(absl::InvalidArgumentError(
        "a push sets lr and weight_decay together or neither"));
  }
  PushArgs args;
  args.step = request.step();
  args.rank = request.rank();
  args.partition = request.partition();
  args.layout_fingerprint = request.layout_fingerprint();
  args.codec = *codec;
  // Nothing reads the request's payload after this: take the bytes instead
  // of copying them (1 MiB per partition in fp32 phases).
  args.payload.swap(*request.mutable_payload());
  args.buffers = request.buffers();
  const int moments =
      request.has_beta1() + request.has_beta2() + request.has_eps();
  if (moments != 0 && (moments != 3 || !request.has_lr())) {
    return done(absl::InvalidArgumentError(
        "a push sets beta1, beta2 and eps together, with lr and weight_decay, "
        "or none of them"));
  }
  if (request.has_lr())
    args.hyper = compress::StepHyper{request.lr(), request.weight_decay()};
  if (moments != 0) {
    args.hyper->moments =
        compress::StepMoments{request.beta1(), request.beta2(), request.eps()};
  }
  if (request.has_first_step()) {
    if (!request.has_lr()) {
      return done(absl::InvalidArgumentError(
          "a push sets first_step only with lr and weight_decay"));
    }
    args.hyper->first_step = request.first_step();
  }
  args.previous_commit.assign(request.previous_commit().begin(),
                              request.previous_commit().end());
  if (request.has_previous_grad_sum_of_squares()) {
    args.previous_grad_sum_of_squares = request.previous_grad_sum_of_squares();
  }
  if (request.has_previous_clip_max_norm())
    args.previous_clip_max_norm = request.previous_clip_max_norm();
  absl::StatusOr<compress::ClipPieces> pieces = ClipPiecesFromWire(
      request.previous_clip_piece_ends(), request.previous_clip_piece_scales());
  if (!pieces.ok()) return done(pieces.status());
  args.previous_clip_pieces = *std::move(pieces);
  args.workers_clip = request.workers_clip();
  if (request.has_x_hash()) args.x_hash = request.x_hash();
  args.previous_amended.swap(*request.mutable_previous_amended());
  if (request.replayed()) {
    args.replay_absent.emplace(request.replay_absent().begin(),
                               request.replay_absent().end());
  }
  (*core)->Push(std::move(args), std::move(done));
}

void ShardHandler::ToMessage(const Reply& reply, v1::PushReply* message) {
  message->set_step(reply.step);
  message->set_partition(reply.partition);
  message->set_codec(proto::ToWire(reply.codec));
  message->set_payload(reply.payload);
  if (!reply.buffers.empty()) message->set_buffers(reply.buffers);
  if (reply.grad_sum_of_squares.has_value())
    message->set_grad_sum_of_squares(*reply.grad_sum_of_squares);
  if (reply.grad_other_norms.has_value()) {
    message->set_grad_sum_abs(reply.grad_other_norms->sum_abs);
    message->set_grad_max_abs(reply.grad_other_norms->max_abs);
  }
  for (uint32_t rank : reply.absent) message->add_absent(rank);
  for (double value : reply.piece_stats) message->add_piece_stats(value);
}

absl::Status ShardHandler::FetchPartition(
    const v1::FetchPartitionRequest& request, v1::PartitionState* reply) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return core.status();
  auto snapshot =
      (*core)->FetchPartition(request.partition(), request.layout_fingerprint(),
                              {.model = !request.skip_model(),
                               .server_error = request.server_error(),
                               .x_hash = request.x_hash()});
  if (!snapshot.ok()) return snapshot.status();
  reply->set_partition(request.partition());
  reply->set_completed_steps(snapshot->completed_steps);
  if (!request.skip_model()) {
    reply->set_x(Bytes(snapshot->x));
    bool m_zero = false, v_zero = false;
    SetArray(snapshot->m, reply->mutable_m(), &m_zero);
    SetArray(snapshot->v, reply->mutable_v(), &v_zero);
    reply->set_m_zero(m_zero);
    reply->set_v_zero(v_zero);
    proto::SetNamedArrays(snapshot->state, reply->mutable_state());
  }
  if (request.server_error())
    reply->set_server_error(Bytes(snapshot->server_error));
  if (request.x_hash()) reply->set_x_hash(snapshot->x_hash);
  return absl::OkStatus();
}

absl::Status ShardHandler::RestorePartition(const v1::PartitionState& request) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return core.status();
  PartitionSnapshot state;
  state.completed_steps = request.completed_steps();
  absl::Status status;
  const auto floats = [&status](const std::string& bytes, const char* what,
                                std::vector<float>* out) {
    if (bytes.size() % 4 != 0) {
      if (status.ok()) {
        status = absl::InvalidArgumentError(absl::StrCat(
            what, ": ", bytes.size(), " bytes is not a whole number of fp32"));
      }
      return;
    }
    out->resize(bytes.size() / 4);
    std::memcpy(out->data(), bytes.data(), bytes.size());
  };
  // An array flagged zero (as FetchPartition gives it) is +0.0 over x's length.
  const auto array = [&](const std::string& bytes, bool zero, const char* what,
                         std::vector<float>* out) {
    if (!zero) return floats(bytes, what, out);
    if (!bytes.empty() && status.ok()) {
      status = absl::InvalidArgumentError(absl::StrCat(
          what, "_zero is set but ", what, " holds ", bytes.size(), " bytes"));
    }
    out->assign(state.x.size(), 0.0f);
  };
  floats(request.x(), "x", &state.x);
  if (request.replace_x()) {
    if (!status.ok()) return status;
    if (!request.m().empty() || !request.v().empty() ||
        !request.server_error().empty() || request.m_zero() ||
        request.v_zero() || request.state_size() > 0) {
      return absl::InvalidArgumentError(
          "replace_x carries x alone: m, v, server_error and state must be "
          "empty");
    }
    return (*core)->ReplaceX(request.rank(), request.partition(),
                             request.layout_fingerprint(),
                             request.completed_steps(), state.x);
  }
  array(request.m(), request.m_zero(), "m", &state.m);
  array(request.v(), request.v_zero(), "v", &state.v);
  floats(request.server_error(), "server_error", &state.server_error);
  if (!status.ok()) return status;
  absl::StatusOr<std::vector<compress::NamedState>> arrays =
      proto::NamedArrays(request.state());
  if (!arrays.ok()) return arrays.status();
  state.state = *std::move(arrays);
  return (*core)->RestorePartition(request.rank(), request.partition(),
                                   request.layout_fingerprint(), state);
}

absl::Status ShardHandler::Abort(const v1::AbortRequest& request) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return core.status();
  return (*core)->Abort(request.rank(), request.step(),
                        request.layout_fingerprint(), request.reason());
}

absl::Status ShardHandler::Commit(const v1::CommitRequest& request) {
  absl::StatusOr<std::shared_ptr<ShardCore>> core = Core();
  if (!core.ok()) return core.status();
  StepCommit commit;
  commit.values.assign(request.commit_values().begin(),
                       request.commit_values().end());
  // A commit without values holds a norm, 0 when the field is absent (as
  // before it was optional); with values, only one that is present.
  if (request.has_grad_sum_of_squares() || commit.values.empty())
    commit.grad_sum_of_squares = request.grad_sum_of_squares();
  if (request.has_clip_max_norm())
    commit.clip_max_norm = request.clip_max_norm();
  absl::StatusOr<compress::ClipPieces> pieces = ClipPiecesFromWire(
      request.clip_piece_ends(), request.clip_piece_scales());
  if (!pieces.ok()) return pieces.status();
  commit.clip_pieces = *std::move(pieces);
  for (const v1::AmendedPartition& part : request.amended())
    commit.amended.emplace_back(part.partition(), part.values());
  return (*core)->CommitStep(request.rank(), request.step(),
                             request.layout_fingerprint(), commit);
}

absl::Status ShardHandler::GetShardInfo(const v1::ShardInfoRequest& request,
                                        v1::ShardInfo* reply) {
  reply->set_shard(host_->shard());
  reply->set_shards(host_->base().shards());
  reply->set_workers(host_->base().workers());
  reply->set_workers_joined(host_->workers_joined());
  reply->set_generation(host_->generation());
  reply->set_workers_joined_next(host_->workers_joined_next());
  std::shared_ptr<ShardCore> core = host_->core();
  reply->set_configured(core != nullptr);
  if (core == nullptr) return absl::OkStatus();
  const ShardStatus s = core->Status();
  reply->set_layout_fingerprint(s.layout_fingerprint);
  reply->set_initialized(s.partitions_initialized == s.partitions);
  reply->set_completed_steps(s.completed_steps);
  reply->set_replies_kept_from(s.replies_kept_from);
  if (request.mirror_checksum())
    reply->set_mirror_checksum(core->MirrorChecksum());
  reply->set_range_begin(s.range.begin);
  reply->set_range_end(s.range.end);
  return absl::OkStatus();
}

}  // namespace morse::server
