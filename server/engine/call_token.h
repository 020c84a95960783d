// CallToken: how the caller of a long engine call (Sample, Step, Evaluate,
// a state dict's export or import) stops it once nobody waits for its
// answer. The rpc layer makes one per call from the call's deadline and
// cancels it when gRPC reports the call gone (the client cancelled, its
// deadline passed, the server shut down); the registry cancels the
// Samples in flight when the server drains. The engine checks it between
// units of work (before a decode step, before a micro-batch, before a
// state is read or loaded) and stops with the status it gives, leaving the
// job as it was. Copies share one state, so the reactor that cancels and
// the job's task that checks hold the same token. Plain C++: no gRPC.
#pragma once

#include <atomic>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ampd::engine {

class CallToken {
 public:
  // No deadline: stops only when cancelled (internal work, tests).
  CallToken() : CallToken(absl::InfiniteFuture()) {}
  // Stops with DeadlineExceeded once `deadline` has passed.
  explicit CallToken(absl::Time deadline) : state_(std::make_shared<State>(deadline)) {}

  // Stops the call with `why` (not OK; an OK status is ignored). The first
  // reason given wins. From any thread; never blocks on the call.
  void Cancel(absl::Status why) const {
    if (why.ok()) return;
    absl::MutexLock lock(&state_->mu);
    if (state_->stopped.load(std::memory_order_relaxed)) return;
    state_->why = std::move(why);
    state_->stopped.store(true, std::memory_order_release);
  }

  // OK while the call should go on; otherwise why it stops, its message
  // prefixed with `where` (what was stopped, and how far it got), its
  // ErrorInfo reason kept: the Cancel's status, or DeadlineExceeded once
  // the deadline has passed. One atomic load and one clock read.
  absl::Status Check(absl::string_view where = "") const {
    absl::Status why;
    if (state_->stopped.load(std::memory_order_acquire)) {
      absl::MutexLock lock(&state_->mu);
      why = state_->why;
    } else if (absl::Now() >= state_->deadline) {
      why = absl::DeadlineExceededError("the call's deadline passed");
    } else {
      return absl::OkStatus();
    }
    if (where.empty()) return why;
    absl::Status out(why.code(), absl::StrCat(where, ": ", why.message()));
    why.ForEachPayload(
        [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
    return out;
  }

  absl::Time deadline() const { return state_->deadline; }

 private:
  struct State {
    explicit State(absl::Time d) : deadline(d) {}
    const absl::Time deadline;
    std::atomic<bool> stopped{false};
    absl::Mutex mu;
    absl::Status why ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<State> state_;
};

// Whether `status` is a CallToken's stop: the call was abandoned or
// interrupted, not refused for what it asked.
inline bool StoppedByCaller(const absl::Status& status) {
  return status.code() == absl::StatusCode::kCancelled ||
         status.code() == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace ampd::engine
