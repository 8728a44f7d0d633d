// Transport security shared by the daemons and the worker library: TLS and
// mutual TLS credentials that follow their files (rotation without restart),
// and bearer tokens read from a file and compared in constant time.
//
// Policy (docs/security.md): plaintext only with `insecure`; otherwise a
// server needs a certificate and key plus a way to authenticate clients (a CA
// for their certificates, a token file, or both), and a worker needs the CA
// that signed the servers' certificates plus a token file or a client
// certificate. The token is checked by the service on every call in every
// mode (gRPC 1.51's AuthMetadataProcessor aborts on insecure credentials).
#ifndef MORSE_PROTO_SECURITY_H_
#define MORSE_PROTO_SECURITY_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "compress/sync.h"
#include "grpcpp/grpcpp.h"

namespace morse::proto {

struct SecurityOptions {
  std::string tls_cert;  // PEM chain: the server's identity, or a worker's
                         // client certificate
  std::string tls_key;   // PEM private key of tls_cert
  std::string tls_ca;    // server: clients' CA (requires client certificates);
                         // worker: servers' CA
  std::string tls_server_name;  // worker: the name to verify instead of the
                                // address's host
  std::string token_file;       // bearer tokens, one per line
  bool insecure = false;        // plaintext, explicitly
  int refresh_seconds =
      30;  // how often certificate and token files are checked for changes

  bool tls() const { return !tls_cert.empty() || !tls_ca.empty(); }
};

// Plaintext, no token (tests and loopback tools).
inline SecurityOptions Insecure() {
  SecurityOptions o;
  o.insecure = true;
  return o;
}

// INVALID_ARGUMENT saying what to pass when the options do not satisfy the
// policy above, or name unreadable files.
absl::Status ValidateServerSecurity(const SecurityOptions& options);
absl::Status ValidateClientSecurity(const SecurityOptions& options);

// Credentials that re-read their files every refresh_seconds. Call after the
// matching Validate*.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const SecurityOptions& options);
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const SecurityOptions& options);
// Adds the server-name override, if any, to a channel's arguments.
void AddChannelSecurityArgs(const SecurityOptions& options,
                            grpc::ChannelArguments* args);

// A token file: one token per line (blank lines and surrounding whitespace
// ignored). On a server, a line `rank=R TOKEN` is worker R's own token:
// a call that carries it may act only as rank R (per-rank identity,
// deploy/make-certs.sh --workers N); a bare TOKEN may act as any rank. Re-read
// when its modification time or size changes, checked at most once per
// `refresh`. A server accepts any listed token (so a rotation can add the new
// token, move clients, then drop the old one); a client sends the first.
// Thread-safe.
class TokenFile {
 public:
  static absl::StatusOr<std::unique_ptr<TokenFile>> Open(
      const std::string& path, absl::Duration refresh);
  // The options' token file, or null when they name none.
  static absl::StatusOr<std::unique_ptr<TokenFile>> FromOptions(
      const SecurityOptions& options);

  // Whether `presented` equals an accepted token; the comparison takes the
  // same time wherever the strings differ.
  bool Accepts(absl::string_view presented);
  // The identity `presented` proves: nullopt if it is no accepted token,
  // kAnyRank for a bare token, the rank for a `rank=R` line.
  static constexpr int64_t kAnyRank = -1;
  std::optional<int64_t> Identify(absl::string_view presented);
  // The token a client sends (a client file's first token; its `rank=R`
  // prefix, if any, is not sent).
  std::string Current();

 private:
  TokenFile(std::string path, absl::Duration refresh)
      : path_(std::move(path)), refresh_(refresh) {}
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const absl::Duration refresh_;
  Mutex mu_;
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> ranks_
      ABSL_GUARDED_BY(mu_);  // kAnyRank or the token's rank
  absl::Time next_check_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t size_ ABSL_GUARDED_BY(mu_) = 0;
};

// Compares in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The metadata key and the value prefix of a bearer token.
inline constexpr char kAuthorizationKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

// The server-side check: OK when `tokens` is null (no token configured) or
// the call carries exactly one "authorization: Bearer <accepted token>";
// UNAUTHENTICATED saying what is wrong otherwise. `rank`, when given, gets
// the identity the token proves (TokenFile::kAnyRank without tokens).
grpc::Status CheckBearerToken(const grpc::ServerContextBase& context,
                              TokenFile* tokens, int64_t* rank = nullptr);

// PERMISSION_DENIED unless a caller of identity `caller` (CheckBearerToken's
// rank) may act as `rank`.
grpc::Status CheckRank(int64_t caller, uint32_t rank);

// A --token_file path with "{rank}" replaced by the worker's rank, so one
// flag serves every worker of a host or a manifest (token-{rank}).
std::string TokenPathForRank(const std::string& path, uint32_t rank);

}  // namespace morse::proto

#endif  // MORSE_PROTO_SECURITY_H_
