// ParseSamples; see exposition.h.
#include "tests/support/exposition.h"

#include <cstdlib>

#include "absl/strings/str_split.h"

namespace ampd::test_support {

std::map<std::string, double> ParseSamples(absl::string_view text) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    // The value follows the last space: label values may contain spaces.
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    const std::string value(line.substr(space + 1));
    samples[std::string(line.substr(0, space))] = std::strtod(value.c_str(), nullptr);
  }
  return samples;
}

}  // namespace ampd::test_support
