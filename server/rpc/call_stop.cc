// CallTokenFor and StopCancelledCall: gRPC's deadline and cancellation as
// the engine's CallToken.
#include "server/rpc/call_stop.h"

#include <chrono>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ampd::rpc {
namespace {

// The server's deadline is the client's timeout counted from the call's
// arrival, so it falls a little after the client's own: the client gives up
// (and cancels) first. A cancel this close to the deadline is the deadline.
constexpr absl::Duration kDeadlineSlack = absl::Seconds(1);

}  // namespace

engine::CallToken CallTokenFor(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  // No deadline reads as the clock's largest time.
  if (deadline == std::chrono::system_clock::time_point::max()) return engine::CallToken();
  return engine::CallToken(absl::FromChrono(deadline));
}

void StopCancelledCall(const engine::CallToken& call) {
  if (absl::Now() + kDeadlineSlack >= call.deadline()) {
    call.Cancel(absl::DeadlineExceededError("the call's deadline passed"));
  } else {
    call.Cancel(absl::CancelledError(
        "the call was cancelled (its client cancelled or went away, or the server's shutdown "
        "timeout passed)"));
  }
}

}  // namespace ampd::rpc
