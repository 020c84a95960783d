// HttpGet over a loopback TCP socket; see http_get.h.
#include "tests/support/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::test_support {
namespace {

// Closes the socket on every return path.
class Socket {
 public:
  Socket() : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

absl::Status Errno(absl::string_view what, int port) {
  return absl::UnavailableError(
      absl::StrCat(what, " 127.0.0.1:", port, " failed: ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(int port, absl::string_view path,
                                     std::chrono::milliseconds timeout) {
  Socket sock;
  if (sock.fd() < 0) return Errno("socket() for", port);
  // SO_SNDTIMEO also bounds connect() on Linux; SO_RCVTIMEO bounds each recv.
  const auto ms = timeout.count();
  timeval tv{.tv_sec = static_cast<time_t>(ms / 1000),
             .tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000)};
  setsockopt(sock.fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(sock.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(sock.fd(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno("connect() to", port);
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    // MSG_NOSIGNAL: a server that closed early is an error, not SIGPIPE.
    const ssize_t n = send(sock.fd(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("send() to", port);
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[8192];
  while (true) {
    const ssize_t n = recv(sock.fd(), buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("recv() (failed or timed out) from", port);
    response.append(buf, static_cast<size_t>(n));
  }
  // "HTTP/1.x NNN reason\r\n...headers...\r\n\r\nbody"
  const size_t header_end = response.find("\r\n\r\n");
  HttpResponse parsed;
  if (header_end == std::string::npos || !absl::StartsWith(response, "HTTP/1.") ||
      response.size() < 12 || response[8] != ' ' ||
      !absl::SimpleAtoi(absl::string_view(response).substr(9, 3), &parsed.status)) {
    return absl::DataLossError(
        absl::StrCat("not an HTTP response: ", absl::string_view(response).substr(0, 200)));
  }
  parsed.headers = response.substr(0, header_end + 2);
  parsed.body = response.substr(header_end + 4);
  return parsed;
}

absl::StatusOr<std::string> HttpGetBody(int port, absl::string_view path) {
  AMPD_ASSIGN_OR_RETURN(HttpResponse response, HttpGet(port, path));
  if (response.status != 200) {
    return absl::FailedPreconditionError(absl::StrCat(
        "not an HTTP 200 response: ", absl::string_view(response.headers).substr(0, 200)));
  }
  return std::move(response.body);
}

}  // namespace ampd::test_support
