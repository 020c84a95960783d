// Waiting on a server's /metrics instead of sleeping: a test that needs a
// call to have started (a Sample running, a peer's Join waiting) polls
// ampd_rpc_in_flight{method} until it says so, with a deadline, rather than
// sleeping a guess that is too long on a fast machine and too short on a
// busy one.
#pragma once

#include <chrono>
#include <map>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"

namespace ampd::test_support {

using Samples = std::map<std::string, double>;  // exposition.h's ParseSamples

// The series ampd_rpc_in_flight{method="METHOD"}.
std::string InFlightSeries(absl::string_view method);

// The value of `series` in `samples`, 0 when absent (a gauge not yet made).
double ValueOf(const Samples& samples, const std::string& series);

// Scrapes 127.0.0.1:`port`/metrics every 10 ms until done(samples) holds;
// false when `timeout` passes first (or every scrape failed).
bool WaitForMetrics(int port, absl::FunctionRef<bool(const Samples&)> done,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// WaitForMetrics until the method has at least `calls` calls in flight.
bool WaitForCallsInFlight(int port, absl::string_view method, double calls = 1,
                          std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace ampd::test_support
