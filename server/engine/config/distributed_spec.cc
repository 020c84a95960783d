// DistributedSpec's validation.
#include "server/engine/config/distributed_spec.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ampd::engine::dist {

namespace {

bool IsGroupChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

bool IsHostChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
}

// HOST:PORT with a port of 1..65535 in digits: HOST a name or IPv4 address
// (no ':', no brackets), or an IPv6 literal in brackets ([::1]:PORT, a zone
// after '%'). Anything else ("[::1", "127.0.0.1:1:2") would pass CreateJob
// and fail every step as an unreachable meeting point.
bool IsHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || address.size() > 255) return false;
  const absl::string_view port_text = address.substr(colon + 1);
  if (port_text.empty() || port_text.size() > 5) return false;
  int port = 0;
  for (char c : port_text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) return false;
  const absl::string_view host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 4 || host.back() != ']') return false;  // at least "[::]"
    const absl::string_view literal = host.substr(1, host.size() - 2);
    const size_t zone = literal.find('%');
    const absl::string_view ip = literal.substr(0, zone);
    if (ip.find(':') == absl::string_view::npos) return false;
    for (char c : ip) {
      if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.') {
        return false;
      }
    }
    if (zone != absl::string_view::npos) {
      const absl::string_view name = literal.substr(zone + 1);
      if (name.empty()) return false;
      for (char c : name) {
        if (!IsHostChar(c)) return false;
      }
    }
    return true;
  }
  for (char c : host) {
    if (!IsHostChar(c)) return false;
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
        spec.timeout_ms != kDefaultTimeoutMs || !spec.secret.empty()) {
      return absl::InvalidArgumentError(
          "world_size: a job of world_size 1 is not distributed; leave rank, group, rendezvous, "
          "timeout_ms and secret unset");
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
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous: must be HOST:PORT of rank 0's --peer-address (a host name, an IPv4 address "
        "or an IPv6 literal in brackets, and a port of 1..65535), got \"",
        absl::CHexEscape(spec.rendezvous.substr(0, 64)), "\""));
  }
  if (spec.timeout_ms < 1 || spec.timeout_ms > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be in [1, ", kMaxTimeoutMs, "], got ", spec.timeout_ms));
  }
  if (spec.secret.size() < kMinSecretBytes || spec.secret.size() > kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "secret: ", kMinSecretBytes, " to ", kMaxSecretBytes,
        " bytes are required, the same on every rank and known only to the job's owner (a "
        "random one per job; the clients pick one), got ",
        spec.secret.size()));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::dist
