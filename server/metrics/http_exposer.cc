// The /metrics accept loop: poll the listening socket and a wake pipe, read
// one request per connection (bounded size and time, so a stuck client
// cannot hold the loop for long; the TLS handshake under the same bound),
// check its token, answer, close.
#include "server/metrics/http_exposer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/sha.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
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
                     const std::string& body, absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", body);
}

std::string Sha256(absl::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return code == 0 ? std::string("unknown error") : std::string(text);
}

// A server context with the certificate chain and key, TLS 1.2 at least.
absl::StatusOr<SSL_CTX*> MakeTlsContext(const ExposerOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "metrics TLS: give both the certificate and its key, or neither");
  }
  if (options.tls_cert_file.empty()) return nullptr;
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return absl::InternalError("metrics TLS: " + OpenSslError());
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, options.tls_cert_file.c_str()) != 1) {
    const std::string why = OpenSslError();
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(
        absl::StrCat("metrics TLS certificate ", options.tls_cert_file, ": ", why));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, options.tls_key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    const std::string why = OpenSslError();
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(
        absl::StrCat("metrics TLS key ", options.tls_key_file, ": ", why));
  }
  return ctx;
}

// One accepted connection, plain or TLS: what Answer reads and writes.
class Connection {
 public:
  Connection(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  ~Connection() {
    if (ssl_ != nullptr) {
      SSL_shutdown(ssl_);
      SSL_free(ssl_);
    }
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // <= 0: closed, timed out or failed.
  ssize_t Read(char* buffer, size_t size) {
    if (ssl_ != nullptr) return SSL_read(ssl_, buffer, static_cast<int>(size));
    for (;;) {
      const ssize_t n = recv(fd_, buffer, size, 0);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }
  bool WriteAll(const std::string& bytes) {
    if (ssl_ == nullptr) return metrics::WriteAll(fd_, bytes);
    size_t done = 0;
    while (done < bytes.size()) {
      const int n = SSL_write(ssl_, bytes.data() + done, static_cast<int>(bytes.size() - done));
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

 private:
  const int fd_;
  SSL* const ssl_;
};

// The value of header `name` (case-insensitive) in a request's text.
std::optional<std::string> Header(const std::string& request, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(request, "\r\n")) {
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    if (absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(line.substr(0, colon)), name)) {
      return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(
    const std::string& listen_address, std::shared_ptr<prometheus::Registry> registry,
    const ExposerOptions& options) {
  AMPD_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(listen_address));
  AMPD_ASSIGN_OR_RETURN(SSL_CTX * tls, MakeTlsContext(options));
  // Freed on every error path below; the exposer owns it once built.
  std::unique_ptr<SSL_CTX, void (*)(SSL_CTX*)> tls_owner(tls, [](SSL_CTX* c) {
    if (c != nullptr) SSL_CTX_free(c);
  });
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
      new HttpExposer(fd, wake[0], wake[1], port, std::move(registry), tls_owner.release(),
                      options.bearer_token.empty() ? "" : Sha256(options.bearer_token)));
}

HttpExposer::HttpExposer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                         std::shared_ptr<prometheus::Registry> registry, ssl_ctx_st* tls,
                         std::string token_digest)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)),
      tls_(tls),
      token_digest_(std::move(token_digest)) {
  thread_ = std::thread([this] { Serve(); });
}

HttpExposer::~HttpExposer() {
  const char byte = 0;
  (void)!write(wake_write_fd_, &byte, 1);
  thread_.join();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
  if (tls_ != nullptr) SSL_CTX_free(tls_);
}

void HttpExposer::Serve() {
  // A scraper that hangs up mid-answer must not kill the process: TLS
  // writes go through write(2), which raises SIGPIPE (plain ones pass
  // MSG_NOSIGNAL). Blocked in this thread only, the signal never arrives.
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
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
  SSL* ssl = nullptr;
  if (tls_ != nullptr) {
    ssl = SSL_new(tls_);
    if (ssl == nullptr) return;
    SSL_set_fd(ssl, connection_fd);
    // Blocking, under the socket's timeouts: a client that stalls the
    // handshake holds the loop no longer than a stalled request would.
    if (SSL_accept(ssl) != 1) {
      ERR_clear_error();
      SSL_free(ssl);
      return;
    }
  }
  Connection connection(connection_fd, ssl);
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t n = connection.Read(buffer, sizeof(buffer));
    if (n <= 0) {
      ERR_clear_error();
      return;  // closed or timed out before a full request
    }
    request.append(buffer, static_cast<size_t>(n));
  }
  connection.WriteAll(Respond(request));
  ERR_clear_error();
}

std::string HttpExposer::Respond(const std::string& request) const {
  // Request line: METHOD SP TARGET SP VERSION.
  const std::string line = request.substr(0, request.find("\r\n"));
  const std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3) {
    return Response("400 Bad Request", "text/plain", "bad request line\n");
  }
  if (!token_digest_.empty()) {
    // Digests of equal length, compared in constant time: the comparison
    // says nothing about the token's length or prefix.
    const std::optional<std::string> authorization = Header(request, "Authorization");
    const bool bearer = authorization.has_value() && authorization->size() > 7 &&
                        absl::EqualsIgnoreCase(authorization->substr(0, 7), "Bearer ");
    const std::string digest = Sha256(bearer ? authorization->substr(7) : std::string());
    if (!bearer || CRYPTO_memcmp(digest.data(), token_digest_.data(), digest.size()) != 0) {
      return Response("401 Unauthorized", "text/plain", "a bearer token is required\n",
                      "WWW-Authenticate: Bearer realm=\"ampd metrics\"\r\n");
    }
  }
  const std::string path = parts[1].substr(0, parts[1].find('?'));
  if (path != "/metrics") {
    return Response("404 Not Found", "text/plain", "try /metrics\n");
  }
  if (parts[0] != "GET") {
    return Response("405 Method Not Allowed", "text/plain", "GET only\n");
  }
  const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
  return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", body);
}

}  // namespace ampd::metrics
