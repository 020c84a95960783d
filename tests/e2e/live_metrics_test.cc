// ampd's /metrics end to end against the real server process: each test
// starts the `ampd` binary (--device=cpu, gRPC and metrics on 127.0.0.1:0,
// the gradient histogram sampled on every step), trains through ampd::Client
// and its stub, and reads the exposition over a real loopback socket the way
// Prometheus does. Unlike tests/metrics/server_metrics_test.cc, which feeds
// the exporter directly, this covers the wiring: engine -> JobObserver,
// rpc layer -> RecordRpc, registry -> OnJobCreated/OnJobDeleted, main.cc's
// ports. Every wait is bounded (a pipe read under a deadline, socket
// timeouts, a child's exit).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "gtest/gtest.h"

namespace ampd {
namespace {

constexpr auto kStartDeadline = std::chrono::seconds(30);
constexpr auto kExitDeadline = std::chrono::seconds(30);
constexpr int kBatchRows = 16;
// Job A trains at a scale its gradients fit under and a growth interval it
// never reaches, so its scale stays put; job B starts at PyTorch's 65536 and
// its first batch carries an inf target, so its first step must back off.
constexpr double kGoodInitScale = 1024;
constexpr double kOverflowInitScale = 65536;
constexpr int kGoodSteps = 3;

// The port after `marker` in `buffer` once its line is complete, else 0.
int PortAfter(const std::string& buffer, const std::string& marker) {
  const size_t at = buffer.find(marker);
  if (at == std::string::npos) return 0;
  const size_t eol = buffer.find('\n', at);
  if (eol == std::string::npos) return 0;
  int port = 0;
  const size_t begin = at + marker.size();
  return absl::SimpleAtoi(buffer.substr(begin, eol - begin), &port) ? port : 0;
}

// A running ampd child process. Its stdout (the two port lines) is read
// through a pipe; its stderr goes to a log file shown when a test fails.
class ServerProcess {
 public:
  explicit ServerProcess(const std::string& log_path) : log_path_(log_path) {
    std::vector<std::string> args = {
        AMPD_SERVER_BINARY, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
        "--device=cpu",     "--worker-threads=2",   "--grad-histogram-every=1"};
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      const int log = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (log >= 0) dup2(log, STDERR_FILENO);
      close(out[0]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    stdout_fd_ = out[0];
    ReadPorts();
  }
  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) close(stdout_fd_);
  }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string Log() const {
    std::ifstream f(log_path_);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  // SIGTERM, then the exit code (-1 on signal death or past the deadline).
  int Terminate() {
    kill(pid_, SIGTERM);
    const pid_t pid = pid_;
    auto done = std::async(std::launch::async, [pid] {
      int status = 0;
      waitpid(pid, &status, 0);
      return status;
    });
    if (done.wait_for(kExitDeadline) != std::future_status::ready) kill(pid_, SIGKILL);
    const int status = done.get();
    exited_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  // main.cc prints the metrics line first and flushes after the listening
  // line, so both arrive by the time the listening line does.
  void ReadPorts() {
    const auto deadline = std::chrono::steady_clock::now() + kStartDeadline;
    std::string buffer;
    while (grpc_port_ == 0 && std::chrono::steady_clock::now() < deadline) {
      pollfd p{stdout_fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left.count()))) <= 0) break;
      char chunk[256];
      const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
      if (n <= 0) break;
      buffer.append(chunk, static_cast<size_t>(n));
      metrics_port_ = PortAfter(buffer, "ampd: metrics on 127.0.0.1:");
      grpc_port_ = PortAfter(buffer, "ampd: listening on 127.0.0.1:");
    }
  }

  std::string log_path_;
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  bool exited_ = false;
};

// GET path from 127.0.0.1:port over HTTP/1.0 (no chunking; the server closes
// the connection after the body). The body, or nullopt with *error set.
std::optional<std::string> HttpGet(int port, const std::string& path, std::string* error) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    *error = "socket() failed";
    return std::nullopt;
  }
  // Bounded: a server that never answers fails the test instead of hanging it.
  timeval timeout{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    *error = absl::StrCat("connect() to 127.0.0.1:", port, " failed");
    return std::nullopt;
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      *error = "send() failed";
      return std::nullopt;
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[8192];
  while (true) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      close(fd);
      *error = "recv() failed or timed out";
      return std::nullopt;
    }
    response.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  const size_t status_end = response.find("\r\n");
  if (header_end == std::string::npos || !absl::StartsWith(response, "HTTP/1.") ||
      response.substr(0, status_end).find(" 200 ") == std::string::npos) {
    *error = "not an HTTP 200 response: " + response.substr(0, 200);
    return std::nullopt;
  }
  return response.substr(header_end + 4);
}

// Sample lines keyed by the series exactly as written (name{labels});
// prometheus-cpp writes labels sorted by name, le last.
std::map<std::string, double> ParseSamples(const std::string& text) {
  std::map<std::string, double> samples;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    samples[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return samples;
}

// One scrape: the text and its samples.
struct Scrape {
  std::string text;
  std::map<std::string, double> samples;

  // The series' value; NaN (which fails any EXPECT_EQ against a number)
  // with a test failure naming the series when it is absent.
  double operator()(const std::string& series) const {
    auto it = samples.find(series);
    EXPECT_NE(it, samples.end()) << series << " missing from:\n" << text;
    return it == samples.end() ? std::nan("") : it->second;
  }
  bool Has(const std::string& series) const { return samples.count(series) > 0; }
};

std::string JobLabel(const std::string& job_id) { return absl::StrCat("{job=\"", job_id, "\"}"); }

class LiveMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = std::filesystem::temp_directory_path() /
            absl::StrCat("ampd_live_metrics_", getpid(), "_", info->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
    server_ = std::make_unique<ServerProcess>((root_ / "ampd.log").string());
    ASSERT_NE(server_->grpc_port(), 0) << "ampd reported no gRPC port; log:\n" << server_->Log();
    ASSERT_NE(server_->metrics_port(), 0) << "ampd reported no metrics port; log:\n"
                                          << server_->Log();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(absl::StrCat("127.0.0.1:", server_->grpc_port()), options);
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "ampd log:\n%s\n", server_->Log().c_str());
    }
    client_.reset();
    server_.reset();
    std::filesystem::remove_all(root_);
  }

  Scrape ScrapeNow() {
    std::string error;
    std::optional<std::string> body = HttpGet(server_->metrics_port(), "/metrics", &error);
    EXPECT_TRUE(body.has_value()) << error;
    Scrape scrape;
    scrape.text = body.value_or("");
    scrape.samples = ParseSamples(scrape.text);
    return scrape;
  }

  // An fp16 AdamW job on the synthetic task (batches of kBatchRows rows).
  absl::StatusOr<v1::Job> CreateJob(uint64_t seed, double init_scale) {
    SyntheticTaskOptions task_options;
    task_options.batch_size = kBatchRows;
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    *config->mutable_model() = SyntheticTask(task_options).Model();
    config->set_seed(seed);
    config->set_display_name(absl::StrCat("live-metrics-", seed));
    config->set_precision(v1::PRECISION_FP16);
    config->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    config->mutable_optimizer()->set_lr(1e-3f);
    config->mutable_scaler()->set_init_scale(init_scale);
    config->mutable_scaler()->set_growth_interval(1000);
    return client_->CreateJob(request);
  }

  // Step `sequence` of job_id with the task's batch of that index; with
  // poison, the batch's first target is +inf, so the scaled gradients
  // overflow whatever the scale.
  absl::StatusOr<v1::StepResponse> Step(const std::string& job_id, int64_t sequence,
                                        bool poison = false) {
    SyntheticTaskOptions task_options;
    task_options.batch_size = kBatchRows;
    task_options.seed = 7;
    SyntheticTask task(task_options);
    v1::StepRequest request;
    request.set_job_id(job_id);
    request.set_sequence(sequence);
    v1::MicroBatch* batch = request.add_micro_batches();
    for (int64_t i = 0; i < sequence; ++i) *batch = task.NextBatch();
    if (poison) {
      const float inf = std::numeric_limits<float>::infinity();
      std::memcpy(batch->mutable_targets()->mutable_data()->data(), &inf, sizeof(float));
    }
    return client_->Step(request);
  }

  // Creates job A (kGoodSteps applied steps) and job B (one overflowing
  // step), checking the step responses so that the metric assertions below
  // rest on a known history. Also returns B's scrape from before its step.
  void TrainBothJobs(v1::Job* a, v1::Job* b, v1::StepResponse* last_a, Scrape* before_b) {
    absl::StatusOr<v1::Job> job_a = CreateJob(1, kGoodInitScale);
    ASSERT_TRUE(job_a.ok()) << job_a.status();
    absl::StatusOr<v1::Job> job_b = CreateJob(2, kOverflowInitScale);
    ASSERT_TRUE(job_b.ok()) << job_b.status();
    *a = *job_a;
    *b = *job_b;
    for (int64_t s = 1; s <= kGoodSteps; ++s) {
      absl::StatusOr<v1::StepResponse> r = Step(a->job_id(), s);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_FALSE(r->skipped()) << "job A's step " << s << " overflowed at scale "
                                 << r->scale_before();
      ASSERT_EQ(r->scale_after(), kGoodInitScale);
      *last_a = *r;
    }
    *before_b = ScrapeNow();
    absl::StatusOr<v1::StepResponse> r = Step(b->job_id(), 1, /*poison=*/true);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->found_inf());
    ASSERT_TRUE(r->skipped());
    ASSERT_EQ(r->scale_before(), kOverflowInitScale);
    ASSERT_EQ(r->scale_after(), kOverflowInitScale / 2);
  }

  std::filesystem::path root_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(LiveMetricsTest, OverflowBackoffAndJobSeriesFollowTheServer) {
  v1::Job a, b;
  v1::StepResponse last_a;
  Scrape before;
  ASSERT_NO_FATAL_FAILURE(TrainBothJobs(&a, &b, &last_a, &before));
  const std::string la = JobLabel(a.job_id());
  const std::string lb = JobLabel(b.job_id());
  const std::string skipped_a =
      absl::StrCat("ampd_skipped_steps_total{job=\"", a.job_id(), "\",reason=\"nonfinite\"}");
  const std::string skipped_b =
      absl::StrCat("ampd_skipped_steps_total{job=\"", b.job_id(), "\",reason=\"nonfinite\"}");

  // Job B as announced at creation, before its step.
  EXPECT_EQ(before("ampd_loss_scale" + lb), kOverflowInitScale);
  EXPECT_EQ(before(skipped_b), 0);
  EXPECT_EQ(before("ampd_loss_scale_backoffs_total" + lb), 0);
  EXPECT_EQ(before("ampd_steps_total" + lb), 0);

  const Scrape after = ScrapeNow();
  // Job B: one step, skipped for inf, scale halved once.
  EXPECT_EQ(after(skipped_b), 1);
  EXPECT_EQ(after("ampd_loss_scale_backoffs_total" + lb), 1);
  EXPECT_EQ(after("ampd_loss_scale_growths_total" + lb), 0);
  EXPECT_EQ(after("ampd_loss_scale" + lb), kOverflowInitScale / 2);
  EXPECT_EQ(after("ampd_steps_total" + lb), 1);
  EXPECT_EQ(after("ampd_samples_total" + lb), kBatchRows);
  // Its sampled histogram saw the non-finite elements: only the +Inf bucket
  // (which the engine shares between >= 2^20, inf and NaN) grows past le=20.
  EXPECT_GT(
      after(absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", b.job_id(), "\",le=\"+Inf\"}")),
      after(absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", b.job_id(), "\",le=\"20\"}")));

  // Job A: every step applied, nothing of B's leaked into its series.
  EXPECT_EQ(after(skipped_a), 0);
  EXPECT_EQ(after("ampd_loss_scale_backoffs_total" + la), 0);
  EXPECT_EQ(after("ampd_loss_scale" + la), kGoodInitScale);
  EXPECT_EQ(after("ampd_steps_total" + la), kGoodSteps);
  EXPECT_EQ(after("ampd_samples_total" + la), kGoodSteps * kBatchRows);
  EXPECT_FLOAT_EQ(static_cast<float>(after("ampd_loss" + la)), last_a.loss());
  // Sampled on every step (--grad-histogram-every=1): each step sees every
  // parameter's gradient once, as a bucket observation or as an exact zero.
  const double observed = after("ampd_grad_magnitude_log2_count" + la);
  EXPECT_GT(observed, 0);
  EXPECT_EQ(observed + after("ampd_grad_zero_elements_total" + la),
            static_cast<double>(kGoodSteps * a.parameter_count()));
  double finite_buckets = 0;
  for (const auto& [series, value] : after.samples) {
    if (absl::StartsWith(series, absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", a.job_id(),
                                              "\",le=\"")) &&
        !absl::StrContains(series, "+Inf")) {
      finite_buckets = std::max(finite_buckets, value);
    }
  }
  EXPECT_GT(finite_buckets, 0) << "no finite ampd_grad_magnitude_log2 bucket of job A counted";

  // Server-wide: both jobs held, every RPC recorded with its code.
  EXPECT_EQ(after("ampd_jobs"), 2);
  EXPECT_EQ(after(R"(ampd_rpc_requests_total{code="OK",method="Step"})"), kGoodSteps + 1);
  EXPECT_EQ(after(R"(ampd_rpc_requests_total{code="OK",method="CreateJob"})"), 2);

  // A refused step (out of sequence) is an RPC error, not a training step.
  absl::StatusOr<v1::StepResponse> refused = Step(a.job_id(), kGoodSteps + 5);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const Scrape refused_scrape = ScrapeNow();
  EXPECT_EQ(refused_scrape(R"(ampd_rpc_requests_total{code="FAILED_PRECONDITION",method="Step"})"),
            1);
  EXPECT_EQ(refused_scrape(R"(ampd_rpc_requests_total{code="OK",method="Step"})"), kGoodSteps + 1);
  EXPECT_EQ(refused_scrape("ampd_steps_total" + la), kGoodSteps);

  // DeleteJob takes every series of B with it, and only B's.
  ASSERT_TRUE(client_->DeleteJob(b.job_id()).ok());
  const Scrape deleted = ScrapeNow();
  EXPECT_FALSE(absl::StrContains(deleted.text, absl::StrCat("job=\"", b.job_id(), "\"")))
      << deleted.text;
  EXPECT_EQ(deleted("ampd_jobs"), 1);
  EXPECT_EQ(deleted(R"(ampd_rpc_requests_total{code="OK",method="DeleteJob"})"), 1);
  EXPECT_EQ(deleted("ampd_steps_total" + la), kGoodSteps);
  EXPECT_EQ(deleted("ampd_loss_scale" + la), kGoodInitScale);

  // A clean SIGTERM shutdown with the metrics server up. The idle channel
  // goes first: nothing polls it between calls, so the server's graceful
  // GOAWAY ping would go unanswered and the drain would wait out gRPC's
  // ping timeout (about 5 s) instead of exiting at once.
  client_.reset();
  EXPECT_EQ(server_->Terminate(), 0);
}

TEST_F(LiveMetricsTest, LiveExpositionPassesPromtool) {
  v1::Job a, b;
  v1::StepResponse last_a;
  Scrape before;
  ASSERT_NO_FATAL_FAILURE(TrainBothJobs(&a, &b, &last_a, &before));
  const Scrape scrape = ScrapeNow();
  ASSERT_TRUE(scrape.Has("ampd_grad_magnitude_log2_count" + JobLabel(a.job_id())))
      << "the lint would not see the histogram:\n"
      << scrape.text;

  const std::filesystem::path file = root_ / "scrape.prom";
  {
    std::ofstream out(file);
    out << scrape.text;
  }
  // promtool is found at configure time; a missing one fails here through
  // the shell's exit status 127 rather than skipping the lint.
  const std::string command =
      absl::StrCat("'", AMPD_PROMTOOL, "' check metrics < '", file.string(), "' 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "promtool (" << AMPD_PROMTOOL << ") rejected the live exposition:\n"
      << output << "\n---\n"
      << scrape.text;
}

}  // namespace
}  // namespace ampd
