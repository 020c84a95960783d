// ParseDashedCommandLine: absl::ParseCommandLine that also accepts the dashed
// spelling of flag names (--state-dir for --state_dir), which is how ampd's
// and ampctl's flags are documented. Only names are rewritten, never values.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/match.h"

namespace ampd {

// `storage` keeps the rewritten arguments alive: the returned positional
// arguments point into it.
inline std::vector<char*> ParseDashedCommandLine(int argc, char** argv,
                                                 std::vector<std::string>& storage) {
  storage.assign(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& arg = storage[i];
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "--")) continue;
    const size_t name_end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(name_end), '-', '_');
  }
  std::vector<char*> pointers;
  for (std::string& arg : storage) pointers.push_back(arg.data());
  return absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
}

}  // namespace ampd
