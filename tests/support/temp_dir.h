// A per-test scratch directory (ampd's --state-dir and log, ampctl's batch
// files) and reading back the files the tests and their children write.
#pragma once

#include <filesystem>
#include <string>

#include "absl/strings/string_view.h"

namespace ampd::test_support {

// <temp>/<prefix>_<pid>_<test name>, created empty and removed with all it
// holds on destruction. The pid keeps concurrent runs of one suite (ctest
// -j runs each test case as its own process) out of each other's way; the
// test name keeps a left-over directory recognisable.
class TempDir {
 public:
  explicit TempDir(absl::string_view prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The whole file, or "" when it cannot be read (a missing log reads as
// empty, which the failure message then shows).
std::string ReadFile(const std::filesystem::path& path);

}  // namespace ampd::test_support
