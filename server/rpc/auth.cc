// Tenants file parsing, constant-time token checks and certificate-named
// tenants; see auth.h.
#include "server/rpc/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/error_reason.h"

namespace ampd::rpc {
namespace {

// A tenants file is a short list written by an operator; anything larger is
// a wrong path, refused before it is read into memory.
constexpr int64_t kMaxTenantsFileBytes = int64_t{1} << 20;
constexpr size_t kMaxTenantNameBytes = 64;

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

absl::StatusOr<TokenDigest> ParseDigest(absl::string_view hex) {
  TokenDigest digest;
  if (hex.size() != 2 * digest.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the token digest must be 64 hex digits (SHA-256), got ", hex.size(), " characters"));
  }
  for (size_t i = 0; i < digest.size(); ++i) {
    const int high = HexValue(hex[2 * i]);
    const int low = HexValue(hex[2 * i + 1]);
    if (high < 0 || low < 0) {
      return absl::InvalidArgumentError("the token digest must be 64 hex digits (SHA-256)");
    }
    digest[i] = static_cast<unsigned char>(high * 16 + low);
  }
  return digest;
}

absl::Status Unauthenticated(absl::string_view message) {
  return WithReason(absl::UnauthenticatedError(message), reason::kUnauthenticated);
}

}  // namespace

TokenDigest Sha256(absl::string_view token) {
  TokenDigest digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest.data());
  return digest;
}

absl::StatusOr<std::vector<Tenant>> ParseTenants(absl::string_view text) {
  std::vector<Tenant> tenants;
  std::set<std::string> names;
  std::set<TokenDigest> digests;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const auto fail = [line_number](absl::string_view message) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", message));
    };
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 2) {
      return fail("expected 'TENANT SHA256_HEX_OF_TOKEN|- [max_jobs=N] [max_memory_bytes=N]'");
    }
    Tenant tenant;
    tenant.name = std::string(fields[0]);
    if (!ValidTenantName(tenant.name)) {
      return fail(absl::StrCat("tenant name '", Echo(tenant.name), "' must be 1 to ",
                               kMaxTenantNameBytes, " of A-Z a-z 0-9 . _ -"));
    }
    if (!names.insert(tenant.name).second) {
      return fail(absl::StrCat("tenant '", tenant.name, "' is listed twice"));
    }
    if (fields[1] == "-") {
      tenant.has_token = false;
    } else {
      absl::StatusOr<TokenDigest> digest = ParseDigest(fields[1]);
      if (!digest.ok()) return fail(digest.status().message());
      if (!digests.insert(*digest).second) {
        return fail("this token digest is already another tenant's");
      }
      tenant.token_sha256 = *digest;
    }
    bool seen_jobs = false;
    bool seen_memory = false;
    for (size_t i = 2; i < fields.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
      int64_t* target = nullptr;
      bool* seen = nullptr;
      if (kv.first == "max_jobs") {
        target = &tenant.max_jobs;
        seen = &seen_jobs;
      } else if (kv.first == "max_memory_bytes") {
        target = &tenant.max_memory_bytes;
        seen = &seen_memory;
      } else {
        return fail(absl::StrCat("unknown field '", Echo(fields[i]),
                                 "' (expected max_jobs=N or max_memory_bytes=N)"));
      }
      if (*seen) return fail(absl::StrCat(kv.first, " is given twice"));
      *seen = true;
      if (!absl::SimpleAtoi(kv.second, target) || *target < 0) {
        return fail(
            absl::StrCat(kv.first, " must be an integer >= 0, got '", Echo(kv.second), "'"));
      }
    }
    tenants.push_back(std::move(tenant));
  }
  if (tenants.empty()) {
    return absl::InvalidArgumentError("no tenant is listed: every call would be refused");
  }
  return tenants;
}

absl::StatusOr<std::vector<Tenant>> LoadTenantsFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  const std::streamoff size = in.tellg();
  if (size < 0 || size > kMaxTenantsFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": larger than ", kMaxTenantsFileBytes, " bytes"));
  }
  in.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), size)) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  absl::StatusOr<std::vector<Tenant>> tenants = ParseTenants(text);
  if (!tenants.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tenants.status().message()));
  }
  return tenants;
}

Authenticator::Authenticator(std::vector<Tenant> tenants, bool tenant_from_client_cert)
    : tenants_(std::move(tenants)), tenant_from_client_cert_(tenant_from_client_cert) {}

const Tenant* Authenticator::FindTenant(absl::string_view name) const {
  for (const Tenant& tenant : tenants_) {
    if (tenant.name == name) return &tenant;
  }
  return nullptr;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  if (open()) return std::string();
  // Only a certificate the handshake verified against --tls-client-ca
  // counts; its common name is the subject's last CN.
  std::optional<std::string> certificate_name;
  if (tenant_from_client_cert_) {
    const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) {
      const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
      if (!names.empty()) certificate_name.emplace(names.back().data(), names.back().size());
    }
  }
  const auto& metadata = context.client_metadata();
  const auto [begin, end] = metadata.equal_range("authorization");
  if (begin == end) return AuthenticateHeader(std::nullopt, false, certificate_name);
  return AuthenticateHeader(absl::string_view(begin->second.data(), begin->second.size()),
                            std::next(begin) != end, certificate_name);
}

absl::StatusOr<std::string> Authenticator::AuthenticateHeader(
    std::optional<absl::string_view> authorization, bool repeated,
    std::optional<absl::string_view> certificate_name) const {
  if (open()) return std::string();
  // A certificate whose name is no tenant's (a gateway's, say) neither
  // admits nor refuses: the token decides.
  const Tenant* certified = (tenant_from_client_cert_ && certificate_name.has_value())
                                ? FindTenant(*certificate_name)
                                : nullptr;
  if (!authorization.has_value()) {
    if (certified != nullptr) return certified->name;
    return Unauthenticated(tenant_from_client_cert_
                               ? "missing 'authorization: Bearer TOKEN' metadata, and no client "
                                 "certificate naming a tenant"
                               : "missing 'authorization: Bearer TOKEN' metadata");
  }
  if (repeated) return Unauthenticated("more than one authorization metadata entry");
  // The scheme is case-insensitive (RFC 6750 follows RFC 7235).
  absl::string_view value = *authorization;
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return Unauthenticated("the authorization metadata must be 'Bearer TOKEN'");
  }
  const TokenDigest presented = Sha256(value.substr(kScheme.size()));
  // Every tenant is compared, whichever matches: the time taken does not
  // depend on where (or whether) the match is.
  const Tenant* match = nullptr;
  for (const Tenant& tenant : tenants_) {
    const bool equal =
        CRYPTO_memcmp(presented.data(), tenant.token_sha256.data(), presented.size()) == 0;
    if (equal && tenant.has_token) match = &tenant;
  }
  if (match == nullptr) return Unauthenticated("unknown token");
  // A certificate issued to one tenant never carries another's token.
  if (certified != nullptr && certified != match) {
    return Unauthenticated("the token and the client certificate name different tenants");
  }
  return match->name;
}

}  // namespace ampd::rpc
