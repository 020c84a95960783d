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
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace ampd::metrics {

class HttpExposer {
 public:
  // Binds listen_address ("HOST:PORT", "[v6]:PORT"; port 0 picks a free
  // one). InvalidArgument for a malformed address, Unavailable when it
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(
      const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry);
  ~HttpExposer();  // stops accepting and joins the thread

  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }

 private:
  HttpExposer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
              std::shared_ptr<prometheus::Registry> registry);
  void Serve();
  void Answer(int connection_fd);

  const int listen_fd_;
  const int wake_read_fd_;  // becomes readable when the destructor asks Serve to stop
  const int wake_write_fd_;
  const int port_;
  const std::shared_ptr<prometheus::Registry> registry_;
  std::thread thread_;
};

}  // namespace ampd::metrics
