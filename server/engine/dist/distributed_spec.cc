// DistributedSpec's validation.
#include "server/engine/dist/distributed_spec.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ampd::engine::dist {

namespace {

bool IsGroupChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

// HOST:PORT with a port in 1..65535 ([v6]:PORT for an IPv6 literal).
bool IsHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || address.size() > 255) return false;
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return false;
  }
  for (char c : address.substr(0, colon)) {
    if (absl::ascii_iscntrl(static_cast<unsigned char>(c)) || c == ' ' || c == '/') return false;
  }
  return true;
}

}  // namespace

absl::Status ValidateDistributedSpec(const DistributedSpec& spec) {
  if (spec.world_size < 1 || spec.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be in [1, ", kMaxWorldSize, "], got ", spec.world_size));
  }
  if (!spec.enabled()) {
    if (spec.rank != 0 || !spec.group.empty() || !spec.rendezvous.empty() ||
        spec.timeout_ms != kDefaultTimeoutMs) {
      return absl::InvalidArgumentError(
          "world_size: a job of world_size 1 is not distributed; leave rank, group, rendezvous "
          "and timeout_ms unset");
    }
    return absl::OkStatus();
  }
  if (spec.rank < 0 || spec.rank >= spec.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, world_size = ", spec.world_size, "), got ", spec.rank));
  }
  if (spec.group.empty() || spec.group.size() > kMaxGroupBytes) {
    return absl::InvalidArgumentError(absl::StrCat("group: 1 to ", kMaxGroupBytes,
                                                   " bytes are required, got ", spec.group.size()));
  }
  for (char c : spec.group) {
    if (!IsGroupChar(c)) {
      return absl::InvalidArgumentError(
          "group: only letters, digits, '.', '_' and '-' are allowed");
    }
  }
  if (!IsHostPort(spec.rendezvous)) {
    return absl::InvalidArgumentError(
        "rendezvous: must be HOST:PORT of rank 0's --peer-address (port 1..65535)");
  }
  if (spec.timeout_ms < 1 || spec.timeout_ms > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be in [1, ", kMaxTimeoutMs, "], got ", spec.timeout_ms));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::dist
