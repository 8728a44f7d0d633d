#include "worker/client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "compress/bytes_hash.h"
#include "compress/optimizer.h"
#include "compress/sync.h"
#include "proto/wire.h"
#include "worker/rpc_status.h"
#include "worker/transport/grpc/transport.h"

namespace morse::worker {

absl::StatusOr<std::unique_ptr<PushClient>> PushClient::Create(
    const proto::JobSpec& job, const compress::Layout& layout,
    std::vector<std::string> servers, uint32_t rank,
    const proto::SecurityOptions& security) {
  auto transport =
      GrpcTransport::Create(job, std::move(servers), rank, security);
  if (!transport.ok()) return transport.status();
  return Create(job, layout, *std::move(transport), rank, !security.insecure);
}

absl::StatusOr<std::unique_ptr<PushClient>> PushClient::Create(
    const proto::JobSpec& job, const compress::Layout& layout,
    std::unique_ptr<Transport> transport, uint32_t rank, bool tls) {
  if (transport->shards() != job.shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a transport to ", transport->shards(),
                     " shards for a job of ", job.shards()));
  }
  if (rank >= job.workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " is outside the job's ", job.workers(), " workers"));
  }
  return std::unique_ptr<PushClient>(
      new PushClient(job, layout, std::move(transport), rank, tls));
}

PushClient::PushClient(const proto::JobSpec& job,
                       const compress::Layout& layout,
                       std::unique_ptr<Transport> transport, uint32_t rank,
                       bool tls)
    : job_(job),
      layout_(layout),
      transport_(std::move(transport)),
      rank_(rank),
      tls_(tls),
      rejoining_(transport_->shards(), false) {}

CallOptions PushClient::Options(double seconds, uint32_t lane) const {
  CallOptions options;
  options.timeout_seconds = seconds;
  options.lane = lane;
  return options;
}

absl::Status PushClient::WaitForShards() {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  absl::Duration backoff = absl::Milliseconds(100);
  std::vector<bool> ready(transport_->shards(), false);
  std::string last_error;
  while (true) {
    for (uint32_t s = 0; s < transport_->shards(); ++s) {
      if (ready[s]) continue;
      // wait_for_ready: the call rides out the channel's own reconnect
      // backoff and returns as soon as the server accepts a connection.
      CallOptions options = Options(1.0);
      options.wait_for_ready = true;
      v1::ShardInfo info;
      const absl::Status status = Wait(&Transport::GetShardInfo, *transport_, s,
                                       v1::ShardInfoRequest(), &info, options);
      if (status.code() == absl::StatusCode::kUnauthenticated ||
          status.code() == absl::StatusCode::kPermissionDenied) {
        return RpcError(status, transport_->address(s));
      }
      if (!status.ok()) {
        last_error =
            absl::StrCat(transport_->address(s), ": ", status.message());
        continue;
      }
      if (info.shard() != s) {
        return absl::FailedPreconditionError(
            absl::StrCat(transport_->address(s), " serves shard ", info.shard(),
                         ", not shard ", s, "; list --servers in shard order"));
      }
      // Whether the shard runs the same job is Join's to check: it can say
      // what differs.
      ready[s] = true;
    }
    if (std::all_of(ready.begin(), ready.end(), [](bool r) { return r; }))
      return absl::OkStatus();
    if (absl::Now() + backoff > deadline) {
      std::vector<std::string> missing;
      for (uint32_t s = 0; s < transport_->shards(); ++s) {
        if (!ready[s]) missing.push_back(transport_->address(s));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "no answer within ", job_.connect_timeout_seconds, " s from ",
          absl::StrJoin(missing, ", "), " (last error: ", last_error, ")",
          tls_ ? "; with TLS a failed handshake looks the same: check "
                 "--tls_ca, the servers' "
                 "certificate names (--tls_server_name) and the client "
                 "certificate"
               : ""));
    }
    std::fprintf(
        stderr,
        "morse-worker %u: waiting for servers (%s); retrying in %.1f s\n",
        rank_, last_error.c_str(), absl::ToDoubleSeconds(backoff));
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

absl::Status PushClient::UploadInitialParameters(absl::Span<const float> x0) {
  for (const compress::Partition& p : layout_.partitions()) {
    v1::InitPartitionRequest request;
    request.set_rank(rank_);
    request.set_partition(p.id);
    request.set_layout_fingerprint(layout_.fingerprint());
    request.set_values(reinterpret_cast<const char*>(x0.data() + p.range.begin),
                       4 * p.range.size());
    v1::InitPartitionReply reply;
    const absl::Status status =
        Wait(&Transport::InitPartition, *transport_, p.shard, request, &reply,
             Options(job_.rpc_timeout_seconds, p.id));
    if (!status.ok()) {
      return RpcError(status, absl::StrCat("uploading partition ", p.id, " to ",
                                           transport_->address(p.shard)));
    }
  }
  return absl::OkStatus();
}

absl::Status PushClient::WaitInitialized() {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  while (true) {
    auto infos = ShardInfosUntil(deadline, absl::Milliseconds(50));
    if (!infos.ok()) return infos.status();
    bool all = true;
    for (const auto& info : *infos) all = all && info.initialized();
    if (all) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "shards not initialized within ", job_.connect_timeout_seconds,
          " s; rank 0 uploads the initial parameters: is it running?"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::StatusOr<int64_t> PushClient::FetchModel(compress::Replica& replica) {
  return Fetch(ModelArrays{&replica}, {});
}

absl::StatusOr<int64_t> PushClient::FetchServerError(
    absl::Span<float> server_error) {
  return Fetch(std::nullopt, server_error);
}

absl::StatusOr<PushClient::ShardsX> PushClient::CompareX(
    absl::Span<const float> x) {
  if (x.size() != layout_.spec().dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x has ", x.size(), " elements, the model ", layout_.spec().dim));
  }
  ShardsX shards;
  absl::StatusOr<int64_t> steps = Fetch(std::nullopt, {}, x, &shards.same);
  if (!steps.ok()) return steps.status();
  shards.completed_steps = *steps;
  return shards;
}

absl::StatusOr<int64_t> PushClient::Fetch(std::optional<ModelArrays> model,
                                          absl::Span<float> server_error,
                                          absl::Span<const float> compare_x,
                                          bool* same) {
  int64_t step = -1;
  if (same != nullptr) *same = true;
  for (const compress::Partition& p : layout_.partitions()) {
    v1::FetchPartitionRequest request;
    request.set_partition(p.id);
    request.set_layout_fingerprint(layout_.fingerprint());
    request.set_skip_model(!model.has_value());
    request.set_server_error(!server_error.empty());
    request.set_x_hash(!compare_x.empty());
    v1::PartitionState state;
    const absl::Status status =
        Wait(&Transport::FetchPartition, *transport_, p.shard, request, &state,
             Options(job_.rpc_timeout_seconds, p.id));
    if (!status.ok()) {
      return RpcError(status,
                      absl::StrCat("fetching partition ", p.id, " from ",
                                   transport_->address(p.shard)));
    }
    const size_t bytes = 4 * p.range.size();
    // An array flagged zero is left out of the message (all +0.0).
    const auto sized = [bytes](const std::string& array, bool zero) {
      return array.size() == (zero ? 0 : bytes);
    };
    if ((model.has_value() &&
         (state.x().size() != bytes || !sized(state.m(), state.m_zero()) ||
          !sized(state.v(), state.v_zero()))) ||
        (!server_error.empty() && state.server_error().size() != bytes)) {
      return absl::InternalError(
          absl::StrCat("partition ", p.id, " came back with the wrong size"));
    }
    if (!compare_x.empty()) {
      if (!state.has_x_hash()) {
        return absl::InternalError(absl::StrCat(
            "partition ", p.id, " came back without its x hash (",
            transport_->address(p.shard), " runs an older morse-server)"));
      }
      if (state.x_hash() !=
          compress::XHash(compare_x.subspan(p.range.begin, p.range.size()))) {
        *same = false;
      }
    }
    // The optimizer's own arrays (onebit_lamb's v' and layer state).
    std::vector<compress::NamedState> own;
    if (model.has_value()) {
      absl::StatusOr<std::vector<compress::NamedState>> arrays =
          proto::NamedArrays(state.state());
      absl::Status checked = arrays.status();
      if (checked.ok()) {
        checked = compress::CheckState(job_.algorithm, p.range.size(), *arrays,
                                       absl::StrCat("partition ", p.id));
      }
      if (!checked.ok()) {
        return absl::InternalError(absl::StrCat(
            "partition ", p.id, " came back wrong: ", checked.message()));
      }
      own = *std::move(arrays);
    }
    if (step >= 0 && state.completed_steps() != step) {
      absl::Status mixed = absl::FailedPreconditionError(
          absl::StrCat("partition ", p.id, " has completed ",
                       state.completed_steps(), " steps, others ", step,
                       ": a shard restarted from its checkpoint is brought "
                       "to the workers' step by their replays (the next "
                       "step's pushes: ask again after it); shards started "
                       "from checkpoints of different steps cannot be (start "
                       "the job again from a saved state)"));
      mixed.SetPayload(kMixedStepsKey, absl::Cord("1"));
      return mixed;
    }
    step = state.completed_steps();
    if (model.has_value()) {
      compress::Replica& r = *model->replica;
      const auto copy = [&](const std::string& array, bool zero, float* to) {
        if (zero) {
          std::fill(to + p.range.begin, to + p.range.end, 0.0f);
        } else {
          std::memcpy(to + p.range.begin, array.data(), bytes);
        }
      };
      std::memcpy(r.x().data() + p.range.begin, state.x().data(), bytes);
      copy(state.m(), state.m_zero(), r.mutable_m().data());
      copy(state.v(), state.v_zero(), r.mutable_v().data());
      // Every shard holds the arrays that are not per element whole.
      if (absl::Status s = r.RestoreState(p.range.begin, p.range.size(), own);
          !s.ok())
        return s;
    }
    if (!server_error.empty()) {
      std::memcpy(server_error.data() + p.range.begin,
                  state.server_error().data(), bytes);
    }
  }
  return step;
}

v1::PartitionState PushClient::RestoreRequest(const compress::Partition& p,
                                              int64_t step,
                                              absl::Span<const float> x) const {
  v1::PartitionState request;
  request.set_rank(rank_);
  request.set_partition(p.id);
  request.set_layout_fingerprint(layout_.fingerprint());
  request.set_completed_steps(step);
  request.set_x(reinterpret_cast<const char*>(x.data() + p.range.begin),
                4 * p.range.size());
  return request;
}

absl::Status PushClient::RestoreModel(
    int64_t step, absl::Span<const float> x, absl::Span<const float> m,
    absl::Span<const float> v, absl::Span<const float> server_error,
    absl::Span<const compress::NamedState> own) {
  const std::vector<compress::StateArray> arrays =
      compress::OptimizerOf(job_.algorithm).State(job_.algorithm);
  if (own.size() != arrays.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the saved state has ", own.size(), " of the ", arrays.size(),
        " arrays ", compress::OptimizerOf(job_.algorithm).name(), " keeps"));
  }
  for (const compress::Partition& p : layout_.partitions()) {
    v1::PartitionState request = RestoreRequest(p, step, x);
    const auto bytes = [&p](absl::Span<const float> a) {
      return std::string(
          reinterpret_cast<const char*>(a.data() + p.range.begin),
          4 * p.range.size());
    };
    request.set_m(bytes(m));
    request.set_v(bytes(v));
    request.set_server_error(bytes(server_error));
    std::vector<compress::NamedState> part;
    for (size_t i = 0; i < arrays.size(); ++i) {
      compress::NamedState& array = part.emplace_back();
      array.name = own[i].name;
      if (arrays[i].per_element) {
        array.values.assign(own[i].values.begin() + p.range.begin,
                            own[i].values.begin() + p.range.end);
      } else {
        array.values = own[i].values;
      }
    }
    proto::SetNamedArrays(part, request.mutable_state());
    v1::RestorePartitionReply reply;
    const absl::Status status =
        Wait(&Transport::RestorePartition, *transport_, p.shard, request,
             &reply, Options(job_.rpc_timeout_seconds, p.id));
    if (!status.ok()) {
      return RpcError(status, absl::StrCat("restoring partition ", p.id, " on ",
                                           transport_->address(p.shard)));
    }
  }
  return absl::OkStatus();
}

absl::Status PushClient::ReplaceX(int64_t step, absl::Span<const float> x) {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  for (const compress::Partition& p : layout_.partitions()) {
    v1::PartitionState request = RestoreRequest(p, step, x);
    request.set_replace_x(true);
    for (;;) {
      v1::RestorePartitionReply reply;
      const absl::Status status =
          Wait(&Transport::RestorePartition, *transport_, p.shard, request,
               &reply, Options(job_.rpc_timeout_seconds, p.id));
      if (status.ok()) break;
      // The partition's last step waits for its commit (rank 0's own, on
      // its way): ask again.
      if (absl::IsUnavailable(status) && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(20));
        continue;
      }
      return RpcError(status,
                      absl::StrCat("changing the weights of partition ", p.id,
                                   " on ", transport_->address(p.shard)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PushClient::CompletedSteps() {
  auto infos = ShardInfos();
  if (!infos.ok()) return infos.status();
  int64_t steps = INT64_MAX;
  for (const v1::ShardInfo& info : *infos)
    steps = std::min(steps, info.completed_steps());
  return steps;
}

absl::StatusOr<std::vector<v1::ShardInfo>> PushClient::ShardInfosUntil(
    absl::Time deadline, absl::Duration pause) {
  while (true) {
    auto infos = ShardInfos();
    if (infos.ok() || !Retryable(infos.status()) || absl::Now() > deadline)
      return infos;
    absl::SleepFor(pause);
  }
}

absl::StatusOr<std::vector<v1::ShardInfo>> PushClient::ShardInfos() {
  std::vector<v1::ShardInfo> infos(transport_->shards());
  for (uint32_t s = 0; s < transport_->shards(); ++s) {
    const absl::Status status =
        Wait(&Transport::GetShardInfo, *transport_, s, v1::ShardInfoRequest(),
             &infos[s], Options(job_.rpc_timeout_seconds));
    if (!status.ok()) {
      return RpcError(status, transport_->address(s));
    }
  }
  return infos;
}

void PushClient::Retain(v1::PushRequest request, uint64_t reply_hash) {
  const int64_t step = request.step();
  const uint32_t partition = request.partition();
  MutexLock lock(&retained_mu_);
  first_retained_ = std::min(first_retained_, step);
  retained_[{step, partition}] = Retained{std::move(request), reply_hash};
  const int64_t oldest = step - static_cast<int64_t>(job_.replay_steps);
  while (!retained_.empty() && retained_.begin()->first.first <= oldest) {
    retained_.erase(retained_.begin());
  }
}

bool PushClient::JoinedAfter(int64_t step) const {
  MutexLock lock(&retained_mu_);
  return step < first_retained_;
}

std::optional<PushClient::Retained> PushClient::Find(int64_t step,
                                                     uint32_t partition) const {
  MutexLock lock(&retained_mu_);
  const auto it = retained_.find({step, partition});
  if (it == retained_.end()) return std::nullopt;
  return it->second;
}

size_t PushClient::retained_pushes() const {
  MutexLock lock(&retained_mu_);
  return retained_.size();
}

void PushClient::Rejoin(uint32_t shard) {
  struct JoinCall {
    v1::JoinRequest request;
    v1::JoinReply reply;
  };
  {
    MutexLock lock(&retained_mu_);
    if (rejoining_[shard]) return;
    rejoining_[shard] = true;
  }
  auto* call = new JoinCall;
  call->request.set_rank(rank_);
  call->request.mutable_job()->ParseFromString(job_.config_proto);
  std::fprintf(
      stderr,
      "morse-worker %u: %s lost the model (restarted); joining it again\n",
      rank_, transport_->address(shard).c_str());
  transport_->Join(
      shard, call->request, &call->reply, Options(job_.rpc_timeout_seconds),
      [this, call, shard](absl::Status status) {
        if (!status.ok()) {
          std::fprintf(stderr, "morse-worker %u: joining %s again: %s\n", rank_,
                       transport_->address(shard).c_str(),
                       std::string(status.message()).c_str());
        }
        delete call;
        MutexLock lock(&retained_mu_);
        rejoining_[shard] = false;
      });
}

absl::Status PushClient::Join() {
  v1::JoinRequest request;
  request.set_rank(rank_);
  if (!request.mutable_job()->ParseFromString(job_.config_proto)) {
    return absl::InternalError("the job config does not serialize");
  }
  for (uint32_t s = 0; s < transport_->shards(); ++s) {
    v1::JoinReply reply;
    const absl::Status status = Wait(&Transport::Join, *transport_, s, request,
                                     &reply, Options(job_.rpc_timeout_seconds));
    if (!status.ok()) {
      return RpcError(status, absl::StrCat("joining ", transport_->address(s)));
    }
    if (reply.layout_fingerprint() != layout_.fingerprint()) {
      return absl::FailedPreconditionError(
          absl::StrCat(transport_->address(s),
                       " has a different layout (D, shards, block_elems or "
                       "partition_elems)"));
    }
  }
  return absl::OkStatus();
}

std::vector<absl::Status> PushClient::CallEach(size_t count,
                                               double timeout_seconds,
                                               const std::vector<bool>& pending,
                                               const StartCall& start) {
  std::vector<absl::Status> statuses(count);
  Mutex mu;
  size_t left = 0;
  for (uint32_t i = 0; i < count; ++i) left += pending.empty() || pending[i];
  for (uint32_t i = 0; i < count; ++i) {
    if (!pending.empty() && !pending[i]) continue;
    start(i, Options(timeout_seconds), [&, i](absl::Status status) {
      MutexLock lock(&mu);
      statuses[i] = std::move(status);
      --left;
    });
  }
  MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](size_t* n) { return *n == 0; }, &left));
  return statuses;
}

absl::Status PushClient::OnEveryShard(double timeout_seconds,
                                      absl::string_view what,
                                      const StartCall& start) {
  const std::vector<absl::Status> statuses =
      CallEach(transport_->shards(), timeout_seconds, {}, start);
  for (uint32_t s = 0; s < statuses.size(); ++s) {
    if (!statuses[s].ok())
      return RpcError(statuses[s],
                      absl::StrCat(what, " ", transport_->address(s)));
  }
  return absl::OkStatus();
}

absl::Status PushClient::Abort(int64_t step, const std::string& reason) {
  v1::AbortRequest request;
  request.set_rank(rank_);
  request.set_step(step);
  request.set_layout_fingerprint(layout_.fingerprint());
  request.set_reason(reason);
  std::vector<v1::AbortReply> replies(transport_->shards());
  return OnEveryShard(
      std::min(job_.rpc_timeout_seconds, 5.0), "stopping the job on",
      [&](uint32_t s, const CallOptions& options, auto done) {
        transport_->Abort(s, request, &replies[s], options, std::move(done));
      });
}

absl::Status PushClient::Commit(
    int64_t step, std::optional<double> grad_sum_of_squares,
    std::optional<float> clip_max_norm, absl::Span<const double> values,
    absl::Span<const compress::ClipPiece> clip_pieces,
    absl::Span<const float> amended) {
  v1::CommitRequest request;
  request.set_rank(rank_);
  request.set_step(step);
  request.set_layout_fingerprint(layout_.fingerprint());
  if (grad_sum_of_squares.has_value())
    request.set_grad_sum_of_squares(*grad_sum_of_squares);
  if (clip_max_norm.has_value()) request.set_clip_max_norm(*clip_max_norm);
  for (double value : values) request.add_commit_values(value);
  for (const compress::ClipPiece& piece : clip_pieces) {
    request.add_clip_piece_ends(piece.end);
    request.add_clip_piece_scales(piece.scale);
  }
  // Where the commit carries the amended gradient, one request for each
  // partition with its values (each the size of an fp32 push, within the
  // messages' limit), all in flight at once; else the one request to
  // every shard.
  std::vector<std::pair<uint32_t, v1::CommitRequest>> calls;
  if (amended.empty()) {
    for (uint32_t s = 0; s < transport_->shards(); ++s)
      calls.emplace_back(s, request);
  } else {
    for (const compress::Partition& p : layout_.partitions()) {
      v1::CommitRequest& part = calls.emplace_back(p.shard, request).second;
      v1::AmendedPartition* values = part.add_amended();
      values->set_partition(p.id);
      values->set_values(
          reinterpret_cast<const char*>(amended.data() + p.range.begin),
          4 * p.range.size());
    }
  }
  const char* what = values.empty() ? "committing the gradient norm to"
                                    : "committing the layer coefficients to";
  // A shard takes the same commit again, so one whose outcome is unknown
  // (refused, reply lost, deadline passed) is sent again, up to the
  // recovery timeout. A shard that restarted from a checkpoint before
  // `step` answers that it has not completed it (with the step it accepts):
  // the pushes the workers replay to it carry the commit (DESIGN 4).
  const absl::Time give_up =
      absl::Now() + absl::Seconds(job_.recovery_timeout_seconds);
  absl::Duration backoff = absl::Milliseconds(20);
  std::vector<bool> pending(calls.size(), true);
  std::vector<v1::CommitReply> replies(calls.size());
  while (true) {
    const std::vector<absl::Status> statuses =
        CallEach(calls.size(), job_.rpc_timeout_seconds, pending,
                 [&](uint32_t i, const CallOptions& options, auto done) {
                   transport_->Commit(calls[i].first, calls[i].second,
                                      &replies[i], options, std::move(done));
                 });
    bool any = false;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!pending[i]) continue;
      const uint32_t s = calls[i].first;
      const absl::Status& status = statuses[i];
      const std::optional<int64_t> accepts = proto::NextStep(status);
      if (status.ok() ||
          (status.code() == absl::StatusCode::kFailedPrecondition &&
           accepts.has_value() && *accepts <= step)) {
        pending[i] = false;
        continue;
      }
      const bool unknown = Retryable(status) ||
                           status.code() == absl::StatusCode::kDeadlineExceeded;
      if (!unknown || absl::Now() >= give_up) {
        return RpcError(status,
                        absl::StrCat(what, " ", transport_->address(s)));
      }
      any = true;
    }
    if (!any) return absl::OkStatus();
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

absl::Status PushClient::WaitAllJoined() {
  const absl::Time deadline =
      absl::Now() + absl::Seconds(job_.connect_timeout_seconds);
  while (true) {
    auto infos = ShardInfosUntil(deadline, absl::Milliseconds(20));
    if (!infos.ok()) return infos.status();
    // A shard that serves an earlier layout generation still waits for
    // workers to join this one (ShardHost::JoinNext).
    uint32_t joined = job_.workers();
    for (const auto& info : *infos) {
      joined = std::min(joined, info.generation() == job_.external.generation
                                    ? info.workers_joined()
                                    : info.workers_joined_next());
    }
    if (joined == job_.workers()) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::FailedPreconditionError(
          absl::StrCat("only ", joined, " of ", job_.workers(),
                       " workers joined within ", job_.connect_timeout_seconds,
                       " s; start every rank (morse-run does)"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace morse::worker
