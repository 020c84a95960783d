// Server credentials from --tls-* files; see tls.h.
#include "server/rpc/tls.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/pem_file.h"
#include "common/status_macros.h"

namespace ampd::rpc {
namespace {

// The file must read as PEM now, so a bad path fails at start naming the
// flag; the provider re-reads it on its own schedule.
absl::Status CheckPemFile(const char* flag, const std::string& path) {
  return ReadPemFile(flag, path).status();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  if (files.cert.empty() && files.key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (files.reload_interval_s == 0) {
    return absl::InvalidArgumentError("--tls-reload-interval-s must be > 0");
  }
  AMPD_RETURN_IF_ERROR(CheckPemFile("--tls-cert", files.cert));
  AMPD_RETURN_IF_ERROR(CheckPemFile("--tls-key", files.key));
  if (!files.client_ca.empty()) {
    AMPD_RETURN_IF_ERROR(CheckPemFile("--tls-client-ca", files.client_ca));
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, files.reload_interval_s);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace ampd::rpc
