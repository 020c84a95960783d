// ConnectRendezvous: ampd.v1.Peer's stub behind dist::Rendezvous. Each call
// carries a deadline a little past the wait it asks the server for, and
// waits for the channel to connect within it (a rank restarting sooner
// than its peers' meeting point is normal, not an error).
#include "server/rpc/peer_client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "ampd/v1/peer.grpc.pb.h"

namespace ampd::rpc {

namespace {

// What a call may take beyond the wait it asks for.
constexpr absl::Duration kSlack = absl::Seconds(5);

absl::Status FromGrpc(const grpc::Status& s, absl::string_view address) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("rendezvous ", address, ": ", s.error_message()));
}

class GrpcRendezvous final : public engine::dist::Rendezvous {
 public:
  GrpcRendezvous(std::string address, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), stub_(v1::Peer::NewStub(channel)) {}

  absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout) override {
    grpc::ClientContext context;
    Prepare(context, timeout);
    v1::JoinRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_world_size(world_size);
    request.set_fingerprint(fingerprint);
    request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    v1::JoinResponse response;
    const grpc::Status s = stub_->Join(&context, request, &response);
    if (!s.ok()) return FromGrpc(s, address_);
    return response.round();
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    grpc::ClientContext context;
    Prepare(context, absl::ZeroDuration());
    v1::SetRequest request;
    request.set_key(key);
    request.set_value(value);
    v1::SetResponse response;
    return FromGrpc(stub_->Set(&context, request, &response), address_);
  }

  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    grpc::ClientContext context;
    Prepare(context, timeout);
    v1::GetRequest request;
    request.set_key(key);
    request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    v1::GetResponse response;
    const grpc::Status s = stub_->Get(&context, request, &response);
    if (!s.ok()) return FromGrpc(s, address_);
    return std::move(*response.mutable_value());
  }

 private:
  static void Prepare(grpc::ClientContext& context, absl::Duration wait) {
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(wait + kSlack));
    context.set_wait_for_ready(true);
  }

  const std::string address_;
  std::unique_ptr<v1::Peer::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<engine::dist::Rendezvous>> ConnectRendezvous(
    const std::string& address) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  if (channel == nullptr) {
    return absl::UnavailableError(absl::StrCat("rendezvous ", address, ": no channel"));
  }
  return std::unique_ptr<engine::dist::Rendezvous>(new GrpcRendezvous(address, channel));
}

}  // namespace ampd::rpc
