// The real `ampd` server as a child process of a test: started on loopback
// ports chosen by the kernel (127.0.0.1:0) with the CPU backend, its ports
// read from the lines main.cc prints ("ampd: metrics on HOST:PORT", then
// "ampd: listening on HOST:PORT"), its stderr kept in a log file for failure
// messages, and stopped with a signal and a bounded wait. The destructor
// kills and reaps a server still running, so a failed ASSERT never leaves a
// stray ampd behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/subprocess.h"

namespace ampd::test_support {

class AmpdProcess {
 public:
  // How long ampd gets to print its listening line: it restores every job in
  // --state-dir first, which is quick for the tests' few small jobs.
  static constexpr std::chrono::seconds kStartDeadline{30};

  // Starts `binary` with --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0
  // --device=cpu --worker-threads=2 followed by `extra_flags`, its stderr
  // appended to `log_path` (appended, so a restart with the same path keeps
  // the first run's log). Returns once ampd printed its listening line,
  // exited or kStartDeadline passed; port() is 0 unless the line came.
  AmpdProcess(const std::string& binary, const std::vector<std::string>& extra_flags,
              std::filesystem::path log_path);
  ~AmpdProcess();
  AmpdProcess(const AmpdProcess&) = delete;
  AmpdProcess& operator=(const AmpdProcess&) = delete;

  // The gRPC and metrics ports ampd reported, 0 when it reported none.
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  // The --peer-address port ampd reported ("ampd: peers on HOST:PORT"), 0
  // when it serves none.
  int peer_port() const { return peer_port_; }
  // The server's process id (-1 when it could not be started), for signals
  // and for what /proc says of it (memory).
  pid_t pid() const { return pid_; }
  // "HOST:PORT" of the gRPC server, for Client::Connect and --server=.
  std::string address() const;

  // Everything ampd wrote to stderr so far.
  std::string Log() const;
  // What a failed start or check should show: why ampd could not be
  // started (if so), the stdout read while waiting for the ports, and the
  // stderr log.
  std::string Describe() const;

  // Sends `sig`, unless the process has already been reaped (its pid may
  // belong to someone else by then).
  void Signal(int sig);
  // Waits for the exit (see WaitForExit: SIGKILL past `deadline`).
  ExitStatus Wait(std::chrono::milliseconds deadline);
  // SIGTERM (ampd drains and exits 0), then Wait.
  ExitStatus Terminate(std::chrono::milliseconds deadline);

 private:
  // Reads stdout until the listening line, EOF or kStartDeadline.
  void ReadPorts();

  std::filesystem::path log_path_;
  std::string start_error_;
  std::string stdout_text_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int stdout_fd_ = -1;
  std::string host_;
  int port_ = 0;
  int metrics_port_ = 0;
  int peer_port_ = 0;
};

}  // namespace ampd::test_support
