// HTTP GET over a plain POSIX socket, for scraping /metrics the way
// Prometheus does. The tests need no HTTP library for this: HTTP/1.0 makes
// the server close the connection after the body, so the response is
// simply everything read until EOF (no keep-alive, no chunking).
#pragma once

#include <chrono>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ampd::test_support {

struct HttpResponse {
  int status = 0;       // from the status line, e.g. 200
  std::string headers;  // the status line and headers, CRLFs included
  std::string body;
};

// GET `path` from 127.0.0.1:`port`. Every socket operation is bounded by
// `timeout`, so a server that never answers fails the test instead of
// hanging it. An error when the connection fails or the answer is not HTTP.
absl::StatusOr<HttpResponse> HttpGet(int port, absl::string_view path,
                                     std::chrono::milliseconds timeout = std::chrono::seconds(10));

// The body of a 200 answer to HttpGet; any other status is an error quoting
// the start of the response.
absl::StatusOr<std::string> HttpGetBody(int port, absl::string_view path);

}  // namespace ampd::test_support
