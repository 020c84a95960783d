// Reading a PEM file named by a flag (--tls-cert, --tls-ca, ...), for the
// server's TLS and the clients' alike: a bounded size (certificates and
// keys are a few KiB; a larger file is a wrong path) and a PEM header, each
// refusal naming the flag and the path.
#pragma once

#include <fstream>
#include <ios>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ampd {

inline constexpr std::streamoff kMaxPemFileBytes = std::streamoff{1} << 20;

// The file's text: NotFound when it cannot be opened, InvalidArgument when
// it is empty, over 1 MiB or holds no "-----BEGIN " line, DataLoss when
// the read fails.
inline absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot open"));
  const std::streamoff size = in.tellg();
  if (size <= 0 || size > kMaxPemFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": expected a PEM file of 1 byte to 1 MiB"));
  }
  in.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), size)) {
    return absl::DataLossError(absl::StrCat(flag, "=", path, ": read failed"));
  }
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": not a PEM file"));
  }
  return text;
}

}  // namespace ampd
