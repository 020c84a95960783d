// Child processes for the tests that drive ampd's binaries (ampd, ampctl,
// promtool): starting one, waiting for it under a deadline, and running a
// command to completion with its output captured for assertions and failure
// messages. Children are started with posix_spawn because the test process
// already runs gRPC threads, and a plain fork() would have the child run
// code (malloc, open) between fork and exec that is unsafe there.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ampd::test_support {

// How a child ended. The default (not exited, code -1) is also what a child
// that could not be started reports, so a check for exit code 0 fails on it.
struct ExitStatus {
  bool exited = false;              // returned from main or called exit()
  int code = -1;                    // the exit code when exited, else -1
  int signal = 0;                   // the signal that ended it, when not exited
  bool killed_at_deadline = false;  // it outlived its deadline and got SIGKILL

  bool signaled() const { return signal != 0; }
  // "exit 2", "signal 9 (killed at the deadline)": for failure messages.
  std::string ToString() const;
};

// Where the child's standard streams go; -1 is /dev/null. The descriptors
// are the caller's and stay open in the parent.
struct ChildStdio {
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

// Starts argv[0] (a path; PATH is not searched) with `argv`. The error names
// the binary when it cannot be executed, so a missing tool fails the test
// with its path instead of a bare exit status.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const ChildStdio& stdio);

// Waits for child `pid` for at most `deadline`. Past it the child is sent
// SIGKILL and reaped, so the child is always gone on return and a hung one
// fails its test instead of hanging it.
ExitStatus WaitForExit(pid_t pid, std::chrono::milliseconds deadline);

// What a finished command printed and how it ended.
struct CommandResult {
  ExitStatus status;
  std::string out;
  std::string err;  // when the command could not be started, why
};

// Runs argv to completion with `input` on its stdin and its stdout and
// stderr captured separately (through pipes, read as they fill, so a
// talkative child never blocks on a full pipe). Past `deadline` the child is
// killed; what it printed up to then is kept for the failure message.
CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds deadline,
                         absl::string_view input = "");

}  // namespace ampd::test_support
