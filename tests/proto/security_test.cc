// The daemons' credential checks at start (proto/security.h): certificates
// that are expired or not yet valid, keys that are not the certificate's,
// and files that only look like PEM are refused with a message naming the
// flag and the file. Certificates are made here with OpenSSL, with the
// validity windows each case needs.
#include "proto/security.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace morse::proto {
namespace {

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string text(data, static_cast<size_t>(n));
  BIO_free(bio);
  return text;
}

// A self-signed P-256 certificate valid from now + not_before to now +
// not_after (seconds), and its key, as PEM.
std::pair<std::string, std::string> SelfSigned(long not_before,
                                               long not_after) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), not_before);
  X509_gmtime_adj(X509_getm_notAfter(cert), not_after);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(
      name, "CN", MBSTRING_ASC,
      reinterpret_cast<const unsigned char*>("morse-test"), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  X509_sign(cert, key, EVP_sha256());
  BIO* cert_bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(cert_bio, cert);
  BIO* key_bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(key_bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  X509_free(cert);
  EVP_PKEY_free(key);
  return {BioText(cert_bio), BioText(key_bio)};
}

class SecurityOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/morse-security-options-XXXXXX";
    dir_ = mkdtemp(pattern);
    Write("token", std::string(64, 'a') + "\n");
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::trunc) << text;
    return path;
  }
  // Writes NAME.pem and NAME.key.
  void Pair(const std::string& name, long not_before, long not_after) {
    const auto [cert, key] = SelfSigned(not_before, not_after);
    Write(name + ".pem", cert);
    Write(name + ".key", key);
  }
  SecurityOptions Server(const std::string& cert, const std::string& key) {
    SecurityOptions o;
    o.tls_cert = dir_ + "/" + cert;
    o.tls_key = dir_ + "/" + key;
    o.token_file = dir_ + "/token";
    return o;
  }
  static void ExpectRefused(const absl::Status& s, const std::string& words) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(words), absl::string_view::npos) << s;
  }

  std::string dir_;
};

TEST_F(SecurityOptionsTest, ValidCertificateAndItsKeyAreAccepted) {
  Pair("server", -60, 86400);
  EXPECT_TRUE(ValidateServerSecurity(Server("server.pem", "server.key")).ok());
  SecurityOptions client;
  client.tls_ca = dir_ + "/server.pem";
  client.token_file = dir_ + "/token";
  EXPECT_TRUE(ValidateClientSecurity(client).ok());
}

TEST_F(SecurityOptionsTest, KeyOfAnotherCertificateIsRefused) {
  Pair("server", -60, 86400);
  Pair("other", -60, 86400);
  ExpectRefused(ValidateServerSecurity(Server("server.pem", "other.key")),
                "--tls_key: " + dir_ +
                    "/other.key is not the key of the certificate in " + dir_ +
                    "/server.pem");
  // A worker's client certificate likewise.
  SecurityOptions client;
  client.tls_ca = dir_ + "/server.pem";
  client.tls_cert = dir_ + "/other.pem";
  client.tls_key = dir_ + "/server.key";
  ExpectRefused(ValidateClientSecurity(client),
                "is not the key of the certificate");
}

TEST_F(SecurityOptionsTest, ExpiredAndNotYetValidCertificatesAreRefused) {
  Pair("expired", -2 * 86400, -86400);
  ExpectRefused(
      ValidateServerSecurity(Server("expired.pem", "expired.key")),
      "--tls_cert: the certificate in " + dir_ + "/expired.pem expired on ");
  Pair("future", 86400, 2 * 86400);
  ExpectRefused(ValidateServerSecurity(Server("future.pem", "future.key")),
                "is not valid before");
  // An expired CA, on either side.
  Pair("server", -60, 86400);
  SecurityOptions server = Server("server.pem", "server.key");
  server.tls_ca = dir_ + "/expired.pem";
  ExpectRefused(ValidateServerSecurity(server), "--tls_ca: the certificate in");
  SecurityOptions client;
  client.tls_ca = dir_ + "/expired.pem";
  client.token_file = dir_ + "/token";
  ExpectRefused(ValidateClientSecurity(client), "expired on");
  // --insecure with a token only reads no certificate.
  SecurityOptions plain;
  plain.insecure = true;
  plain.token_file = dir_ + "/token";
  EXPECT_TRUE(ValidateServerSecurity(plain).ok());
}

TEST_F(SecurityOptionsTest, FilesThatOnlyLookLikePemAreRefused) {
  Pair("server", -60, 86400);
  Write("bad.pem",
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  Write("bad.key",
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
  ExpectRefused(
      ValidateServerSecurity(Server("bad.pem", "server.key")),
      "--tls_cert: " + dir_ + "/bad.pem: cannot parse the certificate");
  ExpectRefused(
      ValidateServerSecurity(Server("server.pem", "bad.key")),
      "--tls_key: " + dir_ + "/bad.key: cannot parse the private key");
}

}  // namespace
}  // namespace morse::proto
