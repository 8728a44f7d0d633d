#include "proto/wire.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "compress/optimizer.h"

namespace morse::proto {

v1::Codec ToWire(compress::CodecKind kind) {
  switch (kind) {
    case compress::CodecKind::kFp32:
      return v1::CODEC_FP32;
    case compress::CodecKind::kFp16:
      return v1::CODEC_FP16;
    case compress::CodecKind::kBf16:
      return v1::CODEC_BF16;
    case compress::CodecKind::kInt8:
      return v1::CODEC_INT8;
    case compress::CodecKind::kInt4:
      return v1::CODEC_INT4;
    case compress::CodecKind::kSign1:
      return v1::CODEC_SIGN1;
    case compress::CodecKind::kTopK:
      return v1::CODEC_TOPK;
  }
  return v1::CODEC_UNSPECIFIED;
}

absl::StatusOr<compress::CodecKind> FromWire(v1::Codec codec) {
  switch (codec) {
    case v1::CODEC_FP32:
      return compress::CodecKind::kFp32;
    case v1::CODEC_FP16:
      return compress::CodecKind::kFp16;
    case v1::CODEC_BF16:
      return compress::CodecKind::kBf16;
    case v1::CODEC_INT8:
      return compress::CodecKind::kInt8;
    case v1::CODEC_INT4:
      return compress::CodecKind::kInt4;
    case v1::CODEC_SIGN1:
      return compress::CodecKind::kSign1;
    case v1::CODEC_TOPK:
      return compress::CodecKind::kTopK;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec ", static_cast<int>(codec)));
  }
}

int MaxMessageBytes(const JobSpec& job) {
  const uint64_t largest =
      job.sized()
          ? std::min<uint64_t>(job.algorithm.layout.partition_elems,
                               job.algorithm.layout.dim)
          : job.algorithm.layout.partition_elems;  // the size comes later
  // The largest messages are RestorePartition's x, m, v and server error,
  // and onebit_lamb's FetchPartition (x, m, v, v'): 16 bytes a value, plus
  // the optimizer's arrays that are not per element (onebit_lamb's layer
  // state, 2 floats a layer) or its commit (3 doubles a layer, with every
  // push); pushes are at most 8 bytes a value (topk at ratio 1).
  const compress::Optimizer& optimizer = compress::OptimizerOf(job.algorithm);
  uint64_t layers = 8 * optimizer.CommitDoubles(job.algorithm);
  for (const compress::StateArray& array : optimizer.State(job.algorithm)) {
    if (!array.per_element) layers = std::max(layers, 4 * array.floats);
  }
  return static_cast<int>(
      std::min<uint64_t>(16 * largest + layers + (1 << 20), INT32_MAX));
}

void SetNamedArrays(absl::Span<const compress::NamedState> arrays,
                    google::protobuf::RepeatedPtrField<v1::NamedArray>* out) {
  for (const compress::NamedState& array : arrays) {
    v1::NamedArray* named = out->Add();
    named->set_name(array.name);
    const bool zero =
        !array.values.empty() &&
        std::all_of(array.values.begin(), array.values.end(), [](float f) {
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          return bits == 0;
        });
    if (zero) {
      named->set_zeros(array.values.size());
    } else {
      named->set_values(array.values.data(), 4 * array.values.size());
    }
  }
}

absl::StatusOr<std::vector<compress::NamedState>> NamedArrays(
    const google::protobuf::RepeatedPtrField<v1::NamedArray>& arrays) {
  std::vector<compress::NamedState> out;
  for (const v1::NamedArray& named : arrays) {
    compress::NamedState& array = out.emplace_back();
    array.name = named.name();
    const std::string& bytes = named.values();
    if (named.zeros() > 0) {
      if (!bytes.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(named.name(), ": ", named.zeros(), " zeros and ",
                         bytes.size(), " bytes of values"));
      }
      if (named.zeros() > (uint64_t{1} << 40)) {
        return absl::InvalidArgumentError(absl::StrCat(
            named.name(), ": ", named.zeros(), " zeros is too many"));
      }
      array.values.assign(named.zeros(), 0.0f);
      continue;
    }
    if (bytes.size() % 4 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(named.name(), ": ", bytes.size(),
                       " bytes is not a whole number of fp32"));
    }
    array.values.resize(bytes.size() / 4);
    std::memcpy(array.values.data(), bytes.data(), bytes.size());
  }
  return out;
}

grpc::ChannelArguments ChannelArgs(const JobSpec& job, int channel_index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(MaxMessageBytes(job));
  args.SetMaxSendMessageSize(MaxMessageBytes(job));
  // Distinct arguments give distinct subchannels, hence distinct TCP streams.
  args.SetInt("morse.channel_index", channel_index);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Backoff between reconnect attempts while servers are not up yet.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

void AcceptKeepalive(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveMs / 2);
}

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {
constexpr const char* kTrailers[] = {kNextStepKey, kNeedsJoinKey,
                                     kStepExpiredKey};
}  // namespace

absl::Status FromGrpc(
    const grpc::Status& status,
    const std::multimap<grpc::string_ref, grpc::string_ref>& trailing) {
  absl::Status out = FromGrpc(status);
  if (out.ok()) return out;
  for (const char* key : kTrailers) {
    const auto it = trailing.find(key);
    if (it != trailing.end())
      SetTrailer(out, key,
                 absl::string_view(it->second.data(), it->second.size()));
  }
  return out;
}

void AddTrailers(const absl::Status& status, grpc::ServerContextBase* context) {
  for (const char* key : kTrailers) {
    if (auto value = status.GetPayload(key))
      context->AddTrailingMetadata(key, std::string(*value));
  }
}

void SetTrailer(absl::Status& status, const char* key,
                absl::string_view value) {
  status.SetPayload(key, absl::Cord(value));
}

std::optional<int64_t> NextStep(const absl::Status& status) {
  const auto value = status.GetPayload(kNextStepKey);
  int64_t step = -1;
  if (!value.has_value() || !absl::SimpleAtoi(std::string(*value), &step) ||
      step < 0)
    return std::nullopt;
  return step;
}

void TuneGrpcForReconnects() {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "300", 0);
}

}  // namespace morse::proto
