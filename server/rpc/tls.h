// The gRPC server credentials of ampd's listening port: plaintext, TLS
// (--tls-cert/--tls-key), or mutual TLS (--tls-client-ca, which makes a
// client certificate signed by that CA a requirement). The files are
// watched by gRPC's FileWatcherCertificateProvider and re-read every
// reload_interval_s, so a rotated certificate, key or client CA is taken
// up by new connections without a restart.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ampd::rpc {

struct TlsFiles {
  std::string cert;       // PEM certificate chain; empty: plaintext
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA(s) client certificates must chain to; empty: none asked
  unsigned int reload_interval_s = 60;
};

// Checks the combination (cert and key together, a client CA only with
// them) and that every named file reads as PEM, so a wrong path stops the
// server at start rather than failing each handshake.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);

}  // namespace ampd::rpc
