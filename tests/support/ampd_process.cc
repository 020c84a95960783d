// Starting ampd and reading its port lines under a deadline; see
// ampd_process.h.
#include "tests/support/ampd_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/support/temp_dir.h"

namespace ampd::test_support {
namespace {

using Clock = std::chrono::steady_clock;

// HOST and PORT of the complete line "<marker>HOST:PORT\n" in `buffer`;
// false until that line has fully arrived.
bool AddressAfter(const std::string& buffer, const std::string& marker, std::string* host,
                  int* port) {
  const size_t at = buffer.find(marker);
  if (at == std::string::npos) return false;
  const size_t begin = at + marker.size();
  const size_t eol = buffer.find('\n', begin);
  if (eol == std::string::npos) return false;
  // The last colon: an IPv6 host keeps its own colons inside brackets.
  const size_t colon = buffer.rfind(':', eol);
  if (colon == std::string::npos || colon < begin) return false;
  if (!absl::SimpleAtoi(absl::string_view(buffer).substr(colon + 1, eol - colon - 1), port)) {
    return false;
  }
  *host = buffer.substr(begin, colon - begin);
  return true;
}

}  // namespace

AmpdProcess::AmpdProcess(const std::string& binary, const std::vector<std::string>& extra_flags,
                         std::filesystem::path log_path)
    : log_path_(std::move(log_path)) {
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
                                   "--device=cpu", "--worker-threads=2"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  const int log = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  int out[2];
  // O_CLOEXEC: later children (ampctl, a second ampd) must not inherit the
  // write end, or this pipe would never see EOF when ampd dies.
  if (log < 0 || pipe2(out, O_CLOEXEC) != 0) {
    start_error_ = absl::StrCat("cannot set up ampd's output (", log_path_.string(),
                                "): ", std::strerror(errno));
    if (log >= 0) close(log);
    return;
  }
  absl::StatusOr<pid_t> pid = Spawn(argv, {.stdin_fd = -1, .stdout_fd = out[1], .stderr_fd = log});
  close(out[1]);
  close(log);
  if (!pid.ok()) {
    close(out[0]);
    start_error_ = std::string(pid.status().message());
    return;
  }
  pid_ = *pid;
  stdout_fd_ = out[0];
  ReadPorts();
}

AmpdProcess::~AmpdProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

void AmpdProcess::ReadPorts() {
  // main.cc prints the metrics and peers lines before the listening line
  // and flushes after the latter, so all have arrived once it has.
  const Clock::time_point deadline = Clock::now() + kStartDeadline;
  while (port_ == 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{stdout_fd_, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    char chunk[256];
    const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: ampd exited before listening
    stdout_text_.append(chunk, static_cast<size_t>(n));
    std::string host;
    int port = 0;
    if (AddressAfter(stdout_text_, "ampd: metrics on ", &host, &port)) metrics_port_ = port;
    if (AddressAfter(stdout_text_, "ampd: peers on ", &host, &port)) peer_port_ = port;
    if (AddressAfter(stdout_text_, "ampd: listening on ", &host, &port)) {
      host_ = host;
      port_ = port;
    }
  }
}

std::string AmpdProcess::address() const { return absl::StrCat(host_, ":", port_); }

std::string AmpdProcess::Log() const { return ReadFile(log_path_); }

std::string AmpdProcess::Describe() const {
  std::string text;
  if (!start_error_.empty()) absl::StrAppend(&text, start_error_, "\n");
  absl::StrAppend(&text, "ampd stdout:\n", stdout_text_, "\nampd stderr (", log_path_.string(),
                  "):\n", Log());
  return text;
}

void AmpdProcess::Signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

ExitStatus AmpdProcess::Wait(std::chrono::milliseconds deadline) {
  if (pid_ <= 0 || reaped_) return ExitStatus{};
  const ExitStatus exit = WaitForExit(pid_, deadline);
  reaped_ = true;
  return exit;
}

ExitStatus AmpdProcess::Terminate(std::chrono::milliseconds deadline) {
  Signal(SIGTERM);
  return Wait(deadline);
}

}  // namespace ampd::test_support
