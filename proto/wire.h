// The protocol layer both sides share: codec enums on the wire, message size
// limits sized to the largest partition, and channel options.
#ifndef MORSE_PROTO_WIRE_H_
#define MORSE_PROTO_WIRE_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "compress/codec.h"
#include "compress/optimizer.h"
#include "grpcpp/grpcpp.h"
#include "proto/job_config.h"
#include "proto/morse.pb.h"

namespace morse::proto {

v1::Codec ToWire(compress::CodecKind kind);
// INVALID_ARGUMENT for CODEC_UNSPECIFIED or an unknown value.
absl::StatusOr<compress::CodecKind> FromWire(v1::Codec codec);

// The largest message either side may send or receive: x, m and v of the
// largest partition (FetchPartition) plus room for the framing.
int MaxMessageBytes(const JobSpec& job);

// An optimizer's own arrays (compress::Optimizer::State) on the wire, in
// order; an array of +0.0 bits only travels as its length (NamedArray's
// zeros). NamedArrays: INVALID_ARGUMENT for values that are not whole fp32
// or a zero array that holds bytes.
void SetNamedArrays(absl::Span<const compress::NamedState> arrays,
                    google::protobuf::RepeatedPtrField<v1::NamedArray>* out);
absl::StatusOr<std::vector<compress::NamedState>> NamedArrays(
    const google::protobuf::RepeatedPtrField<v1::NamedArray>& arrays);

// Channel arguments for a worker's connection to a shard. `channel_index`
// makes each of a shard's channels a separate TCP connection. A worker's
// channels ping their shard after kKeepaliveMs of silence, with or without
// calls in flight, to notice a peer that is gone.
inline constexpr int kKeepaliveMs = 20000;
grpc::ChannelArguments ChannelArgs(const JobSpec& job, int channel_index);

// Has a shard's server accept those pings (gRPC's keepalive guide: a
// server must allow what its clients send). gRPC's defaults for a server
// (no pings without calls, none closer than 5 minutes without data) count
// such pings as strikes, and past two answer with GOAWAY "too_many_pings",
// failing the calls in flight with UNAVAILABLE: the test suite saw that
// once, on both ranks of a job whose connections had been silent for a
// minute while the ranks compiled their models.
void AcceptKeepalive(grpc::ServerBuilder& builder);

// Makes gRPC notice a restarted server within about a second: its client
// channels' backup poller runs every 300 ms instead of 5 s (the
// GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS environment variable, unless
// the user set it). gRPC reads it once, at its first initialization: call
// this before creating any gRPC object.
void TuneGrpcForReconnects();

absl::Status FromGrpc(const grpc::Status& status);
grpc::Status ToGrpc(const absl::Status& status);

// A call's whole outcome as one absl::Status, whatever carried it (gRPC, or
// the in-process transport of the tests): the code and message, and what a
// shard says besides — kNextStepKey, kNeedsJoinKey, kStepExpiredKey of
// job_config.h — as payloads of those names (values as on the wire).
// FromGrpc with the call's trailing metadata; AddTrailers puts a status's
// payloads into a server call's trailing metadata.
absl::Status FromGrpc(
    const grpc::Status& status,
    const std::multimap<grpc::string_ref, grpc::string_ref>& trailing);
void AddTrailers(const absl::Status& status, grpc::ServerContextBase* context);
// Sets one of those payloads.
void SetTrailer(absl::Status& status, const char* key, absl::string_view value);
// The step in a status's kNextStepKey payload, if it has a valid one.
std::optional<int64_t> NextStep(const absl::Status& status);

}  // namespace morse::proto

#endif  // MORSE_PROTO_WIRE_H_
