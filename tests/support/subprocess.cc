// posix_spawn, a deadline-bounded waitpid and a poll loop over a child's
// output pipes; see subprocess.h.
#include "tests/support/subprocess.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace ampd::test_support {
namespace {

using Clock = std::chrono::steady_clock;

// Milliseconds left until `deadline`, never negative, for poll().
int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

// An fd whose reads yield `data`: an in-memory file, so the child's stdin
// needs neither a temporary file nor a writer racing the child's exit
// (which would raise SIGPIPE in the test process).
int InputFd(absl::string_view data) {
  if (data.empty()) return open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int fd = memfd_create("ampd_test_stdin", MFD_CLOEXEC);
  if (fd < 0) return -1;
  size_t written = 0;
  while (written < data.size()) {
    const ssize_t n = write(fd, data.data() + written, data.size() - written);
    if (n <= 0) {
      close(fd);
      return -1;
    }
    written += static_cast<size_t>(n);
  }
  if (lseek(fd, 0, SEEK_SET) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

std::string ExitStatus::ToString() const {
  std::string text;
  if (exited) {
    text = absl::StrCat("exit ", code);
  } else if (signaled()) {
    text = absl::StrCat("signal ", signal);
  } else {
    text = "not started";
  }
  if (killed_at_deadline) absl::StrAppend(&text, " (killed at the deadline)");
  return text;
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const ChildStdio& stdio) {
  if (argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const int fds[3] = {stdio.stdin_fd, stdio.stdout_fd, stdio.stderr_fd};
  for (int target = 0; target < 3; ++target) {
    if (fds[target] >= 0) {
      posix_spawn_file_actions_adddup2(&actions, fds[target], target);
    } else {
      posix_spawn_file_actions_addopen(&actions, target, "/dev/null",
                                       target == 0 ? O_RDONLY : O_WRONLY, 0);
    }
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int error = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start ", argv[0], ": ", std::strerror(error)));
  }
  return pid;
}

ExitStatus WaitForExit(pid_t pid, std::chrono::milliseconds deadline) {
  // waitpid has no timeout: it blocks on a helper thread while this one
  // waits on the future with the deadline.
  auto done = std::async(std::launch::async, [pid] {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  });
  ExitStatus exit;
  if (done.wait_for(deadline) != std::future_status::ready) {
    kill(pid, SIGKILL);
    exit.killed_at_deadline = true;
  }
  const int status = done.get();
  if (WIFEXITED(status)) {
    exit.exited = true;
    exit.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    exit.signal = WTERMSIG(status);
  }
  return exit;
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds deadline,
                         absl::string_view input) {
  const Clock::time_point until = Clock::now() + deadline;
  CommandResult result;
  const int in = InputFd(input);
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (in < 0 || pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    result.err = absl::StrCat("cannot set up the stdio of ", argv.empty() ? "" : argv[0], ": ",
                              std::strerror(errno));
    for (int fd : {in, out[0], out[1], err[0], err[1]}) {
      if (fd >= 0) close(fd);
    }
    return result;
  }
  absl::StatusOr<pid_t> pid = Spawn(argv, {in, out[1], err[1]});
  // The child has its copies; the write ends must close here so that the
  // reads below see EOF when the child exits.
  close(in);
  close(out[1]);
  close(err[1]);
  if (!pid.ok()) {
    close(out[0]);
    close(err[0]);
    result.err = std::string(pid.status().message());
    return result;
  }
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const int ready = poll(fds, 2, MillisLeft(until));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;  // the deadline: WaitForExit below kills the child
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char chunk[4096];
      const ssize_t n = read(fds[i].fd, chunk, sizeof(chunk));
      if (n > 0) {
        sinks[i]->append(chunk, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;  // poll ignores negative fds
        --open_fds;
      }
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  result.status = WaitForExit(*pid, std::chrono::milliseconds(MillisLeft(until)));
  return result;
}

}  // namespace ampd::test_support
