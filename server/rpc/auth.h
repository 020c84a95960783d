// Authentication of Trainer calls. The operator lists tenants in a file
// (--auth-tokens), one a line:
//
//   TENANT SHA256_HEX_OF_TOKEN [max_jobs=N] [max_memory_bytes=N]
//
// so the server never holds a token in clear. A call presents
// "authorization: Bearer TOKEN"; the server hashes TOKEN with SHA-256 and
// compares the digest with every tenant's in constant time, so neither the
// answer's timing nor an early exit tells how much of a guess was right.
// With mutual TLS and --tenant-from-client-cert, a verified client
// certificate whose subject common name is a tenant's name is that tenant
// without a token; a tenant whose digest is written "-" has no token and
// can only call that way. Without a tenants file the Authenticator is open:
// every call passes with an empty tenant name.
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ampd::rpc {

using TokenDigest = std::array<unsigned char, 32>;

struct Tenant {
  std::string name;
  // False for a tenant listed with "-": only its client certificate names it.
  bool has_token = true;
  TokenDigest token_sha256{};
  // The tenant's quotas (0: only the server-wide limits apply).
  int64_t max_jobs = 0;
  int64_t max_memory_bytes = 0;
};

// SHA-256 of `token`.
TokenDigest Sha256(absl::string_view token);

// Parses the text of a tenants file. '#' starts a comment, blank lines are
// skipped. Errors are InvalidArgument and start with "line N: ". Names are
// 1..64 of [A-Za-z0-9._-] and unique, digests are 64 hex digits and unique
// (or "-", no token), and a file with no tenant at all is an error (it would
// refuse every call).
absl::StatusOr<std::vector<Tenant>> ParseTenants(absl::string_view text);

// Reads and parses the file at `path` (errors name the path).
absl::StatusOr<std::vector<Tenant>> LoadTenantsFile(const std::string& path);

class Authenticator {
 public:
  // Open: every call passes, as tenant "".
  Authenticator() = default;
  // Calls must present one of the tenants' tokens or, when
  // `tenant_from_client_cert`, a verified client certificate whose common
  // name is a tenant's name.
  explicit Authenticator(std::vector<Tenant> tenants, bool tenant_from_client_cert = false);

  bool open() const { return tenants_.empty(); }
  bool tenant_from_client_cert() const { return tenant_from_client_cert_; }
  const std::vector<Tenant>& tenants() const { return tenants_; }

  // The calling tenant. A missing, malformed or unknown token (with no
  // certificate naming a tenant), or a token and a certificate naming two
  // different tenants, is UNAUTHENTICATED with reason UNAUTHENTICATED.
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context) const;
  // The same from the value of the authorization metadata (nullopt: absent;
  // `repeated`: the call sent it more than once, which is refused) and the
  // common name of the call's verified client certificate (nullopt: none,
  // or certificates do not name tenants).
  absl::StatusOr<std::string> AuthenticateHeader(
      std::optional<absl::string_view> authorization, bool repeated = false,
      std::optional<absl::string_view> certificate_name = std::nullopt) const;

 private:
  // The tenant named `name`, or nullptr.
  const Tenant* FindTenant(absl::string_view name) const;

  std::vector<Tenant> tenants_;
  bool tenant_from_client_cert_ = false;
};

}  // namespace ampd::rpc
