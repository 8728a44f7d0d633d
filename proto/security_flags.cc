#include "proto/security_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain. Server: its identity (required unless "
          "--insecure). Worker: a "
          "client certificate for servers that require one (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s). Server: require client certificates signed "
          "by it (mutual "
          "TLS). Worker: verify the servers' certificates against it (required "
          "unless "
          "--insecure).");
ABSL_FLAG(std::string, tls_server_name, "",
          "Worker: the name to verify in the servers' certificates instead of "
          "the host in "
          "--servers (for addresses that are not in the certificate).");
ABSL_FLAG(std::string, token_file, "",
          "File of bearer tokens, one per line. Server: every call must carry "
          "one of them; a "
          "line 'rank=R TOKEN' is worker R's own token, and a call carrying it "
          "may act only as "
          "rank R (PERMISSION_DENIED otherwise). Worker: sends the first; "
          "'{rank}' in the path "
          "is replaced by --rank (token-{rank}). Re-read when it changes.");
ABSL_FLAG(int, tls_refresh_seconds, 30,
          "How often certificate, key, CA and token files are checked for "
          "changes (rotation "
          "without restart).");
ABSL_FLAG(
    bool, insecure, false,
    "Plaintext gRPC without TLS (a token is still checked if --token_file is "
    "given). "
    "Without it the daemons refuse to start unless credentials are given.");

namespace morse::proto {

SecurityOptions SecurityOptionsFromFlags() {
  SecurityOptions o;
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.refresh_seconds = absl::GetFlag(FLAGS_tls_refresh_seconds);
  o.insecure = absl::GetFlag(FLAGS_insecure);
  return o;
}

}  // namespace morse::proto
