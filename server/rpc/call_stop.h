// The rpc edge of a long call's engine::CallToken (server/engine/
// call_token.h): made from the gRPC call's deadline, and stopped when gRPC
// reports the call cancelled (its client cancelled or went away, its
// deadline passed, or the server's shutdown deadline passed). The engine
// checks the token between units of work and never sees gRPC.
#pragma once

#include <grpcpp/grpcpp.h>

#include "server/engine/call_token.h"

namespace ampd::rpc {

// A token stopping at the call's deadline (none when it has none).
engine::CallToken CallTokenFor(const grpc::CallbackServerContext& context);

// What a reactor's OnCancel does: stops `call` with DeadlineExceeded when
// its deadline has come (or is within a second: the client's clock runs out
// first), Cancelled otherwise.
void StopCancelledCall(const engine::CallToken& call);

// The reactor of a unary call whose work runs on a job's strand: its
// token goes to the engine, and gRPC's cancellation stops it. Deletes
// itself when the call is done.
class StoppableUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit StoppableUnaryReactor(const grpc::CallbackServerContext& context)
      : call_(CallTokenFor(context)) {}
  const engine::CallToken& call() const { return call_; }
  void OnCancel() override { StopCancelledCall(call_); }
  void OnDone() override { delete this; }

 private:
  const engine::CallToken call_;
};

}  // namespace ampd::rpc
