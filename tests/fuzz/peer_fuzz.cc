// libFuzzer target: the Peer service (ampd.v1.Peer, what another ampd or
// an outsider sends to --peer-address) over a meeting point that hosts one
// group, kPeerGroup. The input is a method byte and a serialized request
// (fuzz_jobs.h); a request may be signed with the group's key, so that
// the table's own checks are reached as well as the refusals. The table is
// shared across inputs with small bounds, so that what earlier inputs
// stored counts against later ones. Invariants: a call never waits (every
// timeout is cut to 0 ms), an unsigned call is refused before it reaches
// the table (never OK, never storing a byte), and the table never holds
// more bytes than its bound.
#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ampd/v1/peer.pb.h"
#include "server/engine/dist/peer_auth.h"
#include "server/engine/dist/rendezvous_table.h"
#include "server/rpc/peer_service.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {

namespace dist = ampd::engine::dist;
namespace fuzz = ampd::fuzz;

dist::RendezvousTable::Limits SmallLimits() {
  dist::RendezvousTable::Limits limits;
  limits.max_groups = 4;
  limits.max_group_bytes = 256 << 10;
  limits.max_bytes = 512 << 10;
  limits.max_waiters = 4;
  limits.max_group_waiters = 2;
  return limits;
}

dist::RendezvousTable& Table() {
  static auto* table = new dist::RendezvousTable(SmallLimits(), [](const std::string& group) {
    return group == fuzz::kPeerGroup
               ? std::vector<dist::RendezvousTable::GroupOwner>{{fuzz::kPeerSecret, "tenant"}}
               : std::vector<dist::RendezvousTable::GroupOwner>();
  });
  return *table;
}

const std::string& GroupKey() {
  static const auto* key = new std::string(dist::GroupKey(fuzz::kPeerSecret, fuzz::kPeerGroup));
  return *key;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t op = data[0];
  const bool sign = (op & fuzz::kPeerSigned) != 0;
  const void* body = data + 1;
  const int length = static_cast<int>(size - 1);
  ampd::rpc::PeerService service(&Table());
  grpc::ServerContext context;
  const size_t bytes_before = Table().bytes();
  grpc::Status status;
  switch (op & 3) {
    case fuzz::kPeerSet: {
      ampd::v1::SetRequest request;
      if (!request.ParseFromArray(body, length)) return 0;
      if (sign) request.set_proof(dist::SetProof(GroupKey(), request.key(), request.value()));
      ampd::v1::SetResponse response;
      status = service.Set(&context, &request, &response);
      if (!sign || dist::GroupOfKey(request.key()) != fuzz::kPeerGroup) {
        fuzz::Check(!status.ok() && Table().bytes() == bytes_before,
                    "a Set not signed with its group's key stores nothing");
      }
      break;
    }
    case fuzz::kPeerGet: {
      ampd::v1::GetRequest request;
      if (!request.ParseFromArray(body, length)) return 0;
      request.set_timeout_ms(0);
      if (sign) request.set_proof(dist::GetProof(GroupKey(), request.key(), 0));
      ampd::v1::GetResponse response;
      status = service.Get(&context, &request, &response);
      if (!sign || dist::GroupOfKey(request.key()) != fuzz::kPeerGroup) {
        fuzz::Check(!status.ok(), "a Get not signed with its group's key reads nothing");
      }
      break;
    }
    default: {
      ampd::v1::JoinRequest request;
      if (!request.ParseFromArray(body, length)) return 0;
      request.set_timeout_ms(0);
      if (sign) {
        request.set_proof(dist::JoinProof(GroupKey(), request.group(), request.rank(),
                                          request.world_size(), request.fingerprint(), 0));
      }
      ampd::v1::JoinResponse response;
      status = service.Join(&context, &request, &response);
      if (!sign || request.group() != fuzz::kPeerGroup) {
        fuzz::Check(!status.ok(), "a Join not signed with its group's key joins nothing");
      }
      break;
    }
  }
  fuzz::Check(Table().bytes() <= SmallLimits().max_bytes, "the table stays within its bytes");
  return 0;
}
