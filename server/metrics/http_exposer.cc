// The /metrics accept loop: poll the listening socket and a wake pipe, read
// one request per connection (bounded size and time, so a stuck client
// cannot hold the loop for long), answer, close.
#include "server/metrics/http_exposer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "prometheus/text_serializer.h"

namespace ampd::metrics {
namespace {

constexpr size_t kMaxRequestBytes = 16 * 1024;
constexpr int kIoTimeoutSeconds = 5;

// "host:port" or "[v6]:port" -> (host, port).
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": expected HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": port must be 0..65535"));
  }
  return std::make_pair(host, address.substr(colon + 1));
}

bool WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string Response(absl::string_view status, absl::string_view content_type,
                     const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(
    const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry) {
  AMPD_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(listen_address));
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const char* host = host_port.first.empty() ? nullptr : host_port.first.c_str();
  if (int rc = getaddrinfo(host, host_port.second.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen_address, ": ", gai_strerror(rc)));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 64) == 0) break;
    last_error = std::strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen_address, ": ", last_error));
  }
  sockaddr_storage bound = {};
  socklen_t bound_len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int port = bound.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    const std::string error = std::strerror(errno);
    close(fd);
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", error));
  }
  return std::unique_ptr<HttpExposer>(
      new HttpExposer(fd, wake[0], wake[1], port, std::move(registry)));
}

HttpExposer::HttpExposer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                         std::shared_ptr<prometheus::Registry> registry)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)) {
  thread_ = std::thread([this] { Serve(); });
}

HttpExposer::~HttpExposer() {
  const char byte = 0;
  (void)!write(wake_write_fd_, &byte, 1);
  thread_.join();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void HttpExposer::Serve() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;  // the client gave up first, or fds ran out: try again
    Answer(connection);
    close(connection);
  }
}

void HttpExposer::Answer(int connection_fd) {
  const timeval timeout{kIoTimeoutSeconds, 0};
  setsockopt(connection_fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(connection_fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t n = recv(connection_fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // closed or timed out before a full request
    request.append(buffer, static_cast<size_t>(n));
  }
  // Request line: METHOD SP TARGET SP VERSION.
  const std::string line = request.substr(0, request.find("\r\n"));
  const std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3) {
    WriteAll(connection_fd, Response("400 Bad Request", "text/plain", "bad request line\n"));
    return;
  }
  const std::string path = parts[1].substr(0, parts[1].find('?'));
  if (path != "/metrics") {
    WriteAll(connection_fd, Response("404 Not Found", "text/plain", "try /metrics\n"));
    return;
  }
  if (parts[0] != "GET") {
    WriteAll(connection_fd, Response("405 Method Not Allowed", "text/plain", "GET only\n"));
    return;
  }
  const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
  WriteAll(connection_fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", body));
}

}  // namespace ampd::metrics
