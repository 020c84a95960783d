// PeerService: each call is the table's, its status mapped to gRPC's.
#include "server/rpc/peer_service.h"

#include <algorithm>

#include "server/rpc/status_mapping.h"

namespace ampd::rpc {

namespace {

absl::Duration Timeout(int64_t timeout_ms) {
  return absl::Milliseconds(std::max<int64_t>(0, timeout_ms));
}

}  // namespace

grpc::Status PeerService::Join(grpc::ServerContext*, const v1::JoinRequest* request,
                               v1::JoinResponse* response) {
  absl::StatusOr<int64_t> round =
      table_->Join(request->group(), request->rank(), request->world_size(), request->fingerprint(),
                   Timeout(request->timeout_ms()));
  if (!round.ok()) return ToGrpcStatus(round.status());
  response->set_round(*round);
  return grpc::Status::OK;
}

grpc::Status PeerService::Set(grpc::ServerContext*, const v1::SetRequest* request,
                              v1::SetResponse*) {
  return ToGrpcStatus(table_->Set(request->key(), request->value()));
}

grpc::Status PeerService::Get(grpc::ServerContext*, const v1::GetRequest* request,
                              v1::GetResponse* response) {
  absl::StatusOr<std::string> value = table_->Get(request->key(), Timeout(request->timeout_ms()));
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

}  // namespace ampd::rpc
