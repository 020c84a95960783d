// See metric_wait.h.
#include "tests/support/metric_wait.h"

#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/support/exposition.h"
#include "tests/support/http_get.h"

namespace ampd::test_support {

std::string InFlightSeries(absl::string_view method) {
  return absl::StrCat("ampd_rpc_in_flight{method=\"", method, "\"}");
}

double ValueOf(const Samples& samples, const std::string& series) {
  auto it = samples.find(series);
  return it == samples.end() ? 0 : it->second;
}

bool WaitForMetrics(int port, absl::FunctionRef<bool(const Samples&)> done,
                    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    absl::StatusOr<std::string> body = HttpGetBody(port, "/metrics");
    if (body.ok() && done(ParseSamples(*body))) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool WaitForCallsInFlight(int port, absl::string_view method, double calls,
                          std::chrono::milliseconds timeout) {
  const std::string series = InFlightSeries(method);
  return WaitForMetrics(
      port, [&](const Samples& samples) { return ValueOf(samples, series) >= calls; }, timeout);
}

}  // namespace ampd::test_support
