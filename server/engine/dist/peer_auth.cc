// Group keys and call proofs: HMAC-SHA256 (OpenSSL) over length-prefixed
// fields.
#include "server/engine/dist/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <initializer_list>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace ampd::engine::dist {

namespace {

// Each field as its 8-byte little-endian length, then its bytes.
std::string Fields(std::initializer_list<absl::string_view> fields) {
  std::string out;
  for (absl::string_view f : fields) {
    uint64_t n = f.size();
    for (int i = 0; i < 8; ++i) {
      out.push_back(static_cast<char>(n & 0xff));
      n >>= 8;
    }
    out.append(f.data(), f.size());
  }
  return out;
}

std::string Hmac(absl::string_view key, absl::string_view message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

}  // namespace

std::string GroupKey(absl::string_view secret, absl::string_view group) {
  return Hmac(secret, Fields({"ampd.v1.Peer group key", group}));
}

std::string JoinProof(absl::string_view key, absl::string_view group, int32_t rank,
                      int32_t world_size, absl::string_view fingerprint, int64_t timeout_ms) {
  return Hmac(key, Fields({"Join", group, absl::StrCat(rank), absl::StrCat(world_size), fingerprint,
                           absl::StrCat(timeout_ms)}));
}

std::string SetProof(absl::string_view key, absl::string_view name, absl::string_view value) {
  return Hmac(key, Fields({"Set", name, value}));
}

std::string GetProof(absl::string_view key, absl::string_view name, int64_t timeout_ms) {
  return Hmac(key, Fields({"Get", name, absl::StrCat(timeout_ms)}));
}

std::string RoomId(absl::string_view group_key, absl::string_view tenant) {
  const std::string digest = Hmac(group_key, Fields({"ampd.v1.Peer room", tenant}));
  return absl::BytesToHexString(absl::string_view(digest).substr(0, 16));
}

bool ProofMatches(absl::string_view expected, absl::string_view received) {
  return expected.size() == received.size() &&
         CRYPTO_memcmp(expected.data(), received.data(), expected.size()) == 0;
}

absl::string_view GroupOfKey(absl::string_view name) {
  const size_t slash = name.find('/');
  return slash == absl::string_view::npos ? absl::string_view() : name.substr(0, slash);
}

}  // namespace ampd::engine::dist
