// Reading Prometheus' text exposition format back in the metrics tests, so
// they can assert on series values instead of matching raw text.
#pragma once

#include <map>
#include <string>

#include "absl/strings/string_view.h"

namespace ampd::test_support {

// The sample lines of `text` keyed by the series exactly as written
// (name{labels}; prometheus-cpp writes labels sorted by name, le last), so
// a test names a series the way a PromQL selector with every label would.
// Comment (# HELP/# TYPE) and blank lines are skipped.
std::map<std::string, double> ParseSamples(absl::string_view text);

}  // namespace ampd::test_support
