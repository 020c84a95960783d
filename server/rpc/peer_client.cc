// ConnectRendezvous: ampd.v1.Peer's stub behind dist::Rendezvous. Each call
// carries the deadline of the wait the rank asked for, and asks the server
// to wait a little less, so that the server's answer (which says how many
// ranks came) arrives before the deadline; the call waits for the channel
// to connect within it (a rank restarting sooner than its peers' meeting
// point is normal, not an error), and a Join the meeting point does not
// know the group of yet (rank 0's job is still being created or restored)
// is tried again until then. So a rank that cannot reach its meeting point
// gives up at its timeout_ms, not later.
#include "server/rpc/peer_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ampd/v1/peer.grpc.pb.h"
#include "server/engine/dist/peer_auth.h"

namespace ampd::rpc {

namespace {

// What the server's wait leaves of the call's deadline for its answer to
// travel back: a tenth of the wait, at most this.
constexpr absl::Duration kAnswerMargin = absl::Milliseconds(500);
// How often a Join is tried again while the meeting point does not know
// the group.
constexpr absl::Duration kJoinRetry = absl::Milliseconds(200);
// A Set waits for nothing; it gets this long to reach the meeting point.
constexpr absl::Duration kSetTimeout = absl::Seconds(10);

// The wait to ask the server for within a call of `deadline` from now.
absl::Duration ServerWait(absl::Duration left) {
  return std::max(absl::ZeroDuration(), left - std::min(kAnswerMargin, left / 10));
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view address) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("rendezvous ", address, ": ", s.error_message()));
}

class GrpcRendezvous final : public engine::dist::Rendezvous {
 public:
  GrpcRendezvous(std::string address, std::string key, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), key_(std::move(key)), stub_(v1::Peer::NewStub(channel)) {}

  absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      grpc::ClientContext context;
      Prepare(context, deadline);
      v1::JoinRequest request;
      request.set_group(group);
      request.set_rank(rank);
      request.set_world_size(world_size);
      request.set_fingerprint(fingerprint);
      request.set_timeout_ms(absl::ToInt64Milliseconds(ServerWait(deadline - absl::Now())));
      request.set_proof(engine::dist::JoinProof(key_, group, rank, world_size, fingerprint,
                                                request.timeout_ms()));
      v1::JoinResponse response;
      const grpc::Status s = stub_->Join(&context, request, &response);
      if (s.ok()) return response.round();
      if (s.error_code() != grpc::StatusCode::NOT_FOUND || absl::Now() + kJoinRetry >= deadline) {
        return FromGrpc(s, address_);
      }
      absl::SleepFor(kJoinRetry);
    }
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    grpc::ClientContext context;
    Prepare(context, absl::Now() + kSetTimeout);
    v1::SetRequest request;
    request.set_key(key);
    request.set_value(value);
    request.set_proof(engine::dist::SetProof(key_, key, value));
    v1::SetResponse response;
    return FromGrpc(stub_->Set(&context, request, &response), address_);
  }

  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    grpc::ClientContext context;
    Prepare(context, absl::Now() + timeout);
    v1::GetRequest request;
    request.set_key(key);
    request.set_timeout_ms(absl::ToInt64Milliseconds(ServerWait(timeout)));
    request.set_proof(engine::dist::GetProof(key_, key, request.timeout_ms()));
    v1::GetResponse response;
    const grpc::Status s = stub_->Get(&context, request, &response);
    if (!s.ok()) return FromGrpc(s, address_);
    return std::move(*response.mutable_value());
  }

 private:
  static void Prepare(grpc::ClientContext& context, absl::Time deadline) {
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
  }

  const std::string address_;
  const std::string key_;  // the group's (GroupKey)
  std::unique_ptr<v1::Peer::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<engine::dist::Rendezvous>> ConnectRendezvous(
    const std::string& address, const std::string& group, const std::string& secret) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  if (channel == nullptr) {
    return absl::UnavailableError(absl::StrCat("rendezvous ", address, ": no channel"));
  }
  return std::unique_ptr<engine::dist::Rendezvous>(
      new GrpcRendezvous(address, engine::dist::GroupKey(secret, group), channel));
}

}  // namespace ampd::rpc
