// HttpExposer: serves GET /metrics (Prometheus text format 0.0.4) from a
// prometheus::Registry on one listening socket and one thread.
//
// Why not prometheus-cpp's own Exposer: it runs on civetweb, which Debian
// builds with a fixed 100 KiB thread stack. glibc refuses to start a thread
// whose stack cannot hold the process's static TLS, and with cuBLASLt and
// OpenBLAS loaded that TLS alone is ~170 KiB, so civetweb could not start a
// single thread inside a CUDA-enabled ampd. Scrapes are rare and small, so a
// plain accept loop that answers one request per connection is enough, and
// it also stops at once instead of after civetweb's 2 s poll.
//
// On a node other tenants share, the exposition can be kept to the
// scraper: over TLS (OpenSSL, the certificate and key read at start) and
// behind a bearer token, both of which Prometheus's scrape config supports
// (scheme: https, tls_config, authorization.credentials_file). A scrape
// without the token gets 401 before anything is collected.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace ampd::metrics {

struct ExposerOptions {
  // PEM files: serve HTTPS (both set) rather than HTTP.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Non-empty: a scrape must send "Authorization: Bearer <token>".
  std::string bearer_token;
};

class HttpExposer {
 public:
  // Binds listen_address ("HOST:PORT", "[v6]:PORT"; port 0 picks a free
  // one). InvalidArgument for a malformed address or TLS files that cannot
  // be loaded (named), Unavailable when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(
      const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry,
      const ExposerOptions& options = {});
  ~HttpExposer();  // stops accepting and joins the thread

  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }

 private:
  HttpExposer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
              std::shared_ptr<prometheus::Registry> registry, ssl_ctx_st* tls,
              std::string token_digest);
  void Serve();
  void Answer(int connection_fd);
  // The answer to one request's text (request line and headers).
  std::string Respond(const std::string& request) const;

  const int listen_fd_;
  const int wake_read_fd_;  // becomes readable when the destructor asks Serve to stop
  const int wake_write_fd_;
  const int port_;
  const std::shared_ptr<prometheus::Registry> registry_;
  ssl_ctx_st* const tls_;           // owned; nullptr: plain HTTP
  const std::string token_digest_;  // SHA-256 of the bearer token; empty: none asked
  std::thread thread_;
};

}  // namespace ampd::metrics
