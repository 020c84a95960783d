// PeerService: ampd.v1.Peer (proto/ampd/v1/peer.proto), the meeting point
// of distributed jobs' ranks, served on --peer-address over the engine's
// RendezvousTable. Every call is authenticated first (its proof against the
// group's key, RendezvousTable::Authenticate), so an outsider's call ends at
// once without waiting or storing anything. Synchronous: Join and Get block
// a gRPC thread while they wait, up to their timeout; the table bounds how
// many wait, in all and per group, below the port's thread count.
#pragma once

#include <grpcpp/grpcpp.h>

#include "ampd/v1/peer.grpc.pb.h"
#include "server/engine/dist/rendezvous_table.h"

namespace ampd::rpc {

class PeerService final : public v1::Peer::Service {
 public:
  // table must outlive the service.
  explicit PeerService(engine::dist::RendezvousTable* table) : table_(table) {}

  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status Set(grpc::ServerContext* context, const v1::SetRequest* request,
                   v1::SetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   v1::GetResponse* response) override;

 private:
  engine::dist::RendezvousTable* const table_;
};

}  // namespace ampd::rpc
