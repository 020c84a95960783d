// See rpc_in_flight.h.
#include "server/metrics/rpc_in_flight.h"

#include "absl/strings/string_view.h"
#include "prometheus/gauge.h"

namespace ampd::metrics {
namespace {

// "/ampd.v1.Trainer/Sample" -> "Sample": the label ampd_rpc_requests_total
// uses for the same method.
absl::string_view ShortName(const char* full) {
  if (full == nullptr) return "unknown";
  const absl::string_view name(full);
  const size_t slash = name.rfind('/');
  return slash == absl::string_view::npos ? name : name.substr(slash + 1);
}

// Counts its call from creation until the status goes out (the hook before
// it is sent: a client that has its answer never sees its call still
// counted), or until gRPC drops the call without sending one.
class InFlight final : public grpc::experimental::Interceptor {
 public:
  explicit InFlight(prometheus::Gauge& gauge) : gauge_(gauge) { gauge_.Increment(); }
  ~InFlight() override { Done(); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      Done();
    }
    methods->Proceed();
  }

 private:
  // gRPC runs a call's hooks one after another and destroys the
  // interceptor after the last: no lock needed.
  void Done() {
    if (counted_) gauge_.Decrement();
    counted_ = false;
  }

  prometheus::Gauge& gauge_;
  bool counted_ = true;
};

class InFlightFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit InFlightFactory(ServerMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new InFlight(metrics_->RpcInFlight(ShortName(info->method())));
  }

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RpcInFlightInterceptors(
    ServerMetrics* metrics) {
  return std::make_unique<InFlightFactory>(metrics);
}

}  // namespace ampd::metrics
