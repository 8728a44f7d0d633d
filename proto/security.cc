#include "proto/security.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace morse::proto {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// Reads `path` and checks that it holds a PEM block whose label ends with
// `label` ("CERTIFICATE", "PRIVATE KEY").
absl::Status CheckPem(const std::string& path, const char* flag,
                      const char* label) {
  auto contents = ReadFile(path, flag);
  if (!contents.ok()) return contents.status();
  if (!absl::StrContains(*contents, absl::StrCat(label, "-----"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " holds no PEM ", label));
  }
  return absl::OkStatus();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Certificate = std::unique_ptr<X509, X509Free>;
using PrivateKey = std::unique_ptr<EVP_PKEY, KeyFree>;

// OpenSSL's last queued error, as text, and the queue cleared.
std::string OpenSslError() {
  const unsigned long code = ERR_peek_last_error();
  ERR_clear_error();
  if (code == 0) return "no detail";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

std::string AsnTime(const ASN1_TIME* t) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new(BIO_s_mem()));
  if (!bio || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// The first certificate in `path`, checked to be valid now.
absl::StatusOr<Certificate> LoadCertificate(const std::string& path,
                                            const char* flag) {
  auto pem = ReadFile(path, flag);
  if (!pem.ok()) return pem.status();
  std::unique_ptr<BIO, BioFree> bio(
      BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size())));
  Certificate cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)
                       : nullptr);
  if (!cert) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, ": cannot parse the certificate (",
                     OpenSslError(), ")"));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": the certificate in ", path, " expired on ",
                     AsnTime(X509_get0_notAfter(cert.get()))));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": the certificate in ", path, " is not valid before ",
        AsnTime(X509_get0_notBefore(cert.get())),
        " (is this machine's clock right?)"));
  }
  return cert;
}

absl::StatusOr<PrivateKey> LoadPrivateKey(const std::string& path) {
  auto pem = ReadFile(path, "tls_key");
  if (!pem.ok()) return pem.status();
  std::unique_ptr<BIO, BioFree> bio(
      BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size())));
  PrivateKey key(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr)
          : nullptr);
  if (!key) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", path, ": cannot parse the private key (",
                     OpenSslError(), "; encrypted keys are not supported)"));
  }
  return key;
}

// What gRPC would only report at handshake time, in its own log: a
// certificate that is expired or not yet valid, or a key that is not the
// certificate's. Checked at start (rotated files are gRPC's to check).
absl::Status CheckCertificates(const SecurityOptions& o) {
  if (!o.tls_cert.empty()) {
    auto cert = LoadCertificate(o.tls_cert, "tls_cert");
    if (!cert.ok()) return cert.status();
    auto key = LoadPrivateKey(o.tls_key);
    if (!key.ok()) return key.status();
    if (X509_check_private_key(cert->get(), key->get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_key: ", o.tls_key,
                       " is not the key of the certificate in ", o.tls_cert));
    }
  }
  if (!o.tls_ca.empty()) {
    if (auto ca = LoadCertificate(o.tls_ca, "tls_ca"); !ca.ok())
      return ca.status();
  }
  return absl::OkStatus();
}

absl::Status CheckFiles(const SecurityOptions& o) {
  if (!o.tls_cert.empty()) {
    if (absl::Status s = CheckPem(o.tls_cert, "tls_cert", "CERTIFICATE");
        !s.ok())
      return s;
  }
  if (!o.tls_key.empty()) {
    if (absl::Status s = CheckPem(o.tls_key, "tls_key", "PRIVATE KEY"); !s.ok())
      return s;
  }
  if (!o.tls_ca.empty()) {
    if (absl::Status s = CheckPem(o.tls_ca, "tls_ca", "CERTIFICATE"); !s.ok())
      return s;
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (absl::Status s = CheckCertificates(o); !s.ok()) return s;
  if (auto tokens = TokenFile::FromOptions(o); !tokens.ok())
    return tokens.status();
  if (o.refresh_seconds < 1)
    return absl::InvalidArgumentError("--tls_refresh_seconds must be >= 1");
  return absl::OkStatus();
}

absl::Status CheckInsecure(const SecurityOptions& o) {
  if (o.tls() || !o.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--insecure turns TLS off; drop it or drop the --tls_* flags");
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::experimental::CertificateProviderInterface> Provider(
    const SecurityOptions& o) {
  const unsigned refresh = static_cast<unsigned>(o.refresh_seconds);
  if (o.tls_cert.empty()) {
    return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        o.tls_ca, refresh);
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      o.tls_key, o.tls_cert, o.tls_ca, refresh);
}

}  // namespace

absl::Status ValidateServerSecurity(const SecurityOptions& o) {
  if (o.insecure) {
    if (absl::Status s = CheckInsecure(o); !s.ok()) return s;
    return CheckFiles(o);
  }
  if (o.tls_cert.empty() || o.tls_key.empty() ||
      (o.tls_ca.empty() && o.token_file.empty())) {
    return absl::InvalidArgumentError(
        "refusing to serve without credentials: pass --tls_cert and --tls_key "
        "(this server's "
        "certificate and key) and a way to authenticate workers: --tls_ca "
        "(require client "
        "certificates signed by this CA) and/or --token_file (require a bearer "
        "token); or pass "
        "--insecure to serve plaintext on a network you trust");
  }
  return CheckFiles(o);
}

absl::Status ValidateClientSecurity(const SecurityOptions& o) {
  if (o.insecure) {
    if (absl::Status s = CheckInsecure(o); !s.ok()) return s;
    return CheckFiles(o);
  }
  if (o.tls_ca.empty() || (o.token_file.empty() && o.tls_cert.empty())) {
    return absl::InvalidArgumentError(
        "refusing to connect without credentials: pass --tls_ca (the CA that "
        "signed the "
        "servers' certificates) and --token_file (a bearer token) and/or "
        "--tls_cert and "
        "--tls_key (a client certificate); or pass --insecure for plaintext on "
        "a network you "
        "trust");
  }
  return CheckFiles(o);
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const SecurityOptions& o) {
  if (o.insecure) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(Provider(o));
  options.watch_identity_key_cert_pairs();
  if (!o.tls_ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const SecurityOptions& o) {
  if (o.insecure) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(o));
  options.watch_root_certs();
  if (!o.tls_cert.empty()) options.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(options);
}

void AddChannelSecurityArgs(const SecurityOptions& o,
                            grpc::ChannelArguments* args) {
  if (!o.insecure && !o.tls_server_name.empty()) {
    args->SetSslTargetNameOverride(o.tls_server_name);
  }
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer string is visited whatever the contents.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::FromOptions(
    const SecurityOptions& o) {
  if (o.token_file.empty()) return nullptr;
  return Open(o.token_file, absl::Seconds(o.refresh_seconds));
}

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::Open(
    const std::string& path, absl::Duration refresh) {
  std::unique_ptr<TokenFile> file(new TokenFile(path, refresh));
  MutexLock lock(&file->mu_);
  if (absl::Status s = file->Load(); !s.ok()) return s;
  return file;
}

absl::Status TokenFile::Load() {
  struct stat st;
  if (stat(path_.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_file: cannot read ", path_));
  }
  auto contents = ReadFile(path_, "token_file");
  if (!contents.ok()) return contents.status();
  std::vector<std::string> tokens;
  std::vector<int64_t> ranks;
  for (absl::string_view line : absl::StrSplit(*contents, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    int64_t rank = kAnyRank;
    if (absl::ConsumePrefix(&line, "rank=")) {
      const size_t space = line.find_first_of(" \t");
      uint32_t r = 0;
      if (space == absl::string_view::npos ||
          !absl::SimpleAtoi(line.substr(0, space), &r)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--token_file: ", path_,
                         ": a 'rank=' line must be 'rank=R TOKEN'"));
      }
      rank = r;
      line = absl::StripAsciiWhitespace(line.substr(space));
    }
    tokens.emplace_back(line);
    ranks.push_back(rank);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_file: ", path_, " holds no token"));
  }
  tokens_ = std::move(tokens);
  ranks_ = std::move(ranks);
  mtime_ns_ =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  size_ = st.st_size;
  next_check_ = absl::Now() + refresh_;
  return absl::OkStatus();
}

void TokenFile::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now < next_check_) return;
  next_check_ = now + refresh_;
  struct stat st;
  if (stat(path_.c_str(), &st) != 0)
    return;  // mid-rotation: keep the tokens we have
  const int64_t mtime =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (mtime == mtime_ns_ && st.st_size == size_) return;
  // A file without tokens (being rewritten) keeps the previous ones.
  (void)Load();
}

bool TokenFile::Accepts(absl::string_view presented) {
  return Identify(presented).has_value();
}

std::optional<int64_t> TokenFile::Identify(absl::string_view presented) {
  MutexLock lock(&mu_);
  MaybeReload();
  std::optional<int64_t> identity;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (ConstantTimeEquals(presented, tokens_[i]) && !identity.has_value())
      identity = ranks_[i];
  }
  return identity;
}

std::string TokenFile::Current() {
  MutexLock lock(&mu_);
  MaybeReload();
  return tokens_.front();
}

grpc::Status CheckRank(int64_t caller, uint32_t rank) {
  if (caller == TokenFile::kAnyRank || caller == static_cast<int64_t>(rank))
    return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("this bearer token is rank ", caller,
                                   "'s; it cannot act as rank ", rank));
}

std::string TokenPathForRank(const std::string& path, uint32_t rank) {
  return absl::StrReplaceAll(path, {{"{rank}", absl::StrCat(rank)}});
}

grpc::Status CheckBearerToken(const grpc::ServerContextBase& context,
                              TokenFile* tokens, int64_t* rank) {
  if (rank != nullptr) *rank = TokenFile::kAnyRank;
  if (tokens == nullptr) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  if (metadata.count(kAuthorizationKey) > 1) {
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        "more than one authorization header; send exactly one bearer token");
  }
  const auto it = metadata.find(kAuthorizationKey);
  if (it == metadata.end()) {
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        "missing bearer token: this server requires 'authorization: Bearer "
        "<token>' (morse-worker --token_file)");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  const std::optional<int64_t> identity =
      absl::StartsWith(value, kBearerPrefix)
          ? tokens->Identify(value.substr(sizeof(kBearerPrefix) - 1))
          : std::nullopt;
  if (!identity.has_value()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "invalid bearer token");
  }
  if (rank != nullptr) *rank = *identity;
  return grpc::Status::OK;
}

}  // namespace morse::proto
