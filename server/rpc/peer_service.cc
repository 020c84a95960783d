// PeerService: each call is the table's, in the room of the job whose
// secret signed it (RendezvousTable::Authenticate), its status mapped to
// gRPC's. A
// waiting call ends at its own deadline, or as soon as its caller cancels:
// past that nobody listens for the answer, and the thread it holds is
// wanted by other peers.
#include "server/rpc/peer_service.h"

#include <algorithm>
#include <chrono>

#include "server/engine/dist/peer_auth.h"
#include "server/rpc/status_mapping.h"

namespace ampd::rpc {

namespace {

// The wait a call asked for, cut to its own deadline.
absl::Duration Timeout(const grpc::ServerContext& context, int64_t timeout_ms) {
  const absl::Duration asked = absl::Milliseconds(std::max<int64_t>(0, timeout_ms));
  const absl::Duration left =
      absl::FromChrono(context.deadline() - std::chrono::system_clock::now());
  return std::max(absl::ZeroDuration(), std::min(asked, left));
}

}  // namespace

grpc::Status PeerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                               v1::JoinResponse* response) {
  const absl::StatusOr<engine::dist::RendezvousTable::Member> member = table_->Authenticate(
      request->group(),
      [request](absl::string_view key) {
        return engine::dist::JoinProof(key, request->group(), request->rank(),
                                       request->world_size(), request->fingerprint(),
                                       request->timeout_ms());
      },
      request->proof());
  if (!member.ok()) return ToGrpcStatus(member.status());
  absl::StatusOr<int64_t> round = table_->Join(
      *member, request->rank(), request->world_size(), request->fingerprint(),
      Timeout(*context, request->timeout_ms()), [context] { return context->IsCancelled(); });
  if (!round.ok()) return ToGrpcStatus(round.status());
  response->set_round(*round);
  return grpc::Status::OK;
}

grpc::Status PeerService::Set(grpc::ServerContext*, const v1::SetRequest* request,
                              v1::SetResponse*) {
  const absl::StatusOr<engine::dist::RendezvousTable::Member> member = table_->Authenticate(
      std::string(engine::dist::GroupOfKey(request->key())),
      [request](absl::string_view key) {
        return engine::dist::SetProof(key, request->key(), request->value());
      },
      request->proof());
  if (!member.ok()) return ToGrpcStatus(member.status());
  return ToGrpcStatus(table_->Set(*member, request->key(), request->value()));
}

grpc::Status PeerService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                              v1::GetResponse* response) {
  const absl::StatusOr<engine::dist::RendezvousTable::Member> member = table_->Authenticate(
      std::string(engine::dist::GroupOfKey(request->key())),
      [request](absl::string_view key) {
        return engine::dist::GetProof(key, request->key(), request->timeout_ms());
      },
      request->proof());
  if (!member.ok()) return ToGrpcStatus(member.status());
  absl::StatusOr<std::string> value =
      table_->Get(*member, request->key(), Timeout(*context, request->timeout_ms()),
                  [context] { return context->IsCancelled(); });
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

}  // namespace ampd::rpc
