// TempDir and ReadFile; see temp_dir.h.
#include "tests/support/temp_dir.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace ampd::test_support {

TempDir::TempDir(absl::string_view prefix) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  // A parametrised test's name has a '/' (Name/fp16): kept, it would make a
  // nested directory whose parent outlives the test.
  std::string name = info != nullptr ? info->name() : "no_test";
  std::replace(name.begin(), name.end(), '/', '_');
  path_ = std::filesystem::temp_directory_path() / absl::StrCat(prefix, "_", getpid(), "_", name);
  // A directory left by a crashed run with a recycled pid must not leak
  // its files into this one.
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;  // a destructor must not throw
  std::filesystem::remove_all(path_, ignored);
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace ampd::test_support
