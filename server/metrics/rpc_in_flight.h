// The gRPC server interceptor behind ampd_rpc_in_flight{method}: each call
// counts from the moment the server hands it to its handler until its
// status is about to be sent (gRPC creates one interceptor per call, just
// before the handler runs). A gauge that can be polled is what tells an
// operator, or a test, that a long call (a Sample, a peer's Join or Get) is
// running, where ampd_rpc_requests_total counts only finished calls. It sits
// on the builders of both the Trainer and the peer port, so nothing in the
// rpc layer's handlers changes.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "server/metrics/server_metrics.h"

namespace ampd::metrics {

// The factory to add to a grpc::ServerBuilder's interceptor creators; the
// metrics must outlive the server it is built into.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RpcInFlightInterceptors(
    ServerMetrics* metrics);

}  // namespace ampd::metrics
