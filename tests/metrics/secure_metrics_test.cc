// /metrics of a real ampd on a node tenants share (docs/OPERATIONS.md, Security):
// served over HTTPS with certificates from scripts/make-dev-certs.sh,
// answered only with the scrape token, and without anything that names a
// tenant or one of its jobs. Scraped with curl the way Prometheus scrapes
// it (scheme https, a CA file, a bearer token) and linted with promtool.
#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

constexpr std::chrono::seconds kCommandDeadline{60};

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

class SecureMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CommandResult made =
        RunCommand({"/bin/bash", AMPD_MAKE_CERTS, dir_.path().string()}, kCommandDeadline);
    ASSERT_EQ(made.status.code, 0)
        << "make-dev-certs.sh failed (" << made.status.ToString() << "):\n"
        << made.out << made.err;
    token_ = "scrape-token-5e0c1d";
    std::ofstream(dir_.path() / "scrape.token") << token_ << "\n";
  }

  std::string Path(const std::string& name) const { return (dir_.path() / name).string(); }

  // curl's body and HTTP status for GET /metrics over HTTPS with
  // `authorization` (none when empty).
  std::pair<std::string, int> Scrape(int port, const std::string& authorization) {
    std::vector<std::string> argv = {AMPD_CURL, "-sS", "--cacert", Path("ca.crt"),
                                     "-o",      "-",   "-w",       "\n%{http_code}"};
    if (!authorization.empty()) {
      argv.push_back("-H");
      argv.push_back("Authorization: " + authorization);
    }
    argv.push_back(absl::StrCat("https://127.0.0.1:", port, "/metrics"));
    const CommandResult got = RunCommand(argv, kCommandDeadline);
    EXPECT_EQ(got.status.code, 0) << got.status.ToString() << ": " << got.err;
    const size_t last = got.out.rfind('\n');
    if (last == std::string::npos) return {got.out, 0};
    int code = 0;
    (void)absl::SimpleAtoi(got.out.substr(last + 1), &code);
    return {got.out.substr(0, last), code};
  }

  TempDir dir_{"ampd_secure_metrics"};
  std::string token_;
};

TEST_F(SecureMetricsTest, HttpsWithATokenAndNoTenantOrJobNames) {
  AmpdProcess server(
      AMPD_SERVER_BINARY,
      {"--auth-tokens=" + Path("tenants"), "--metrics-tls-cert=" + Path("server.crt"),
       "--metrics-tls-key=" + Path("server.key"), "--metrics-token-file=" + Path("scrape.token"),
       "--metrics-tenant-labels=false"},
      dir_.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  ASSERT_NE(server.metrics_port(), 0) << server.Describe();

  // A tenant's job that has stepped: its series exist.
  ClientOptions alice;
  alice.token = ReadFile(dir_.path() / "alice.token");
  std::unique_ptr<Client> client = Client::Connect(server.address(), alice);
  SyntheticTask task(SyntheticTaskOptions{});
  v1::CreateJobRequest request;
  *request.mutable_config()->mutable_model() = task.Model();
  request.mutable_config()->set_precision(v1::PRECISION_FP16);
  request.mutable_config()->set_display_name("alice-secret-project");
  absl::StatusOr<v1::Job> job = client->CreateJob(request);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::StepRequest step;
  step.set_job_id(job->job_id());
  step.set_sequence(1);
  *step.add_micro_batches() = task.NextBatch();
  ASSERT_TRUE(client->Step(step).ok());

  const auto [text, code] = Scrape(server.metrics_port(), "Bearer " + token_);
  ASSERT_EQ(code, 200) << text;
  EXPECT_NE(text.find("ampd_loss_scale{job=\"j"), std::string::npos) << text;
  EXPECT_EQ(text.find(job->job_id()), std::string::npos) << text;
  EXPECT_EQ(text.find("alice"), std::string::npos) << text;
  EXPECT_EQ(text.find("tenant="), std::string::npos) << text;
  const CommandResult lint =
      RunCommand({AMPD_PROMTOOL, "check", "metrics"}, kCommandDeadline, text);
  EXPECT_TRUE(lint.status.exited && lint.status.code == 0)
      << "promtool rejected the exposition (" << lint.status.ToString() << "):\n"
      << lint.out << lint.err << "\n---\n"
      << text;

  // Without the token, with another one, or as plain HTTP: nothing.
  for (const std::string& authorization : {std::string(), std::string("Bearer wrong-token"),
                                           "Basic " + token_, "Bearer " + token_ + "x"}) {
    const auto [refused, refused_code] = Scrape(server.metrics_port(), authorization);
    EXPECT_EQ(refused_code, 401) << authorization;
    EXPECT_EQ(refused.find("ampd_"), std::string::npos) << refused;
  }
  absl::StatusOr<test_support::HttpResponse> plain =
      test_support::HttpGet(server.metrics_port(), "/metrics", std::chrono::seconds(5));
  EXPECT_FALSE(plain.ok() && plain->status == 200);
  // The endpoint still serves after the refusals and the plain-text try.
  EXPECT_EQ(Scrape(server.metrics_port(), "Bearer " + token_).second, 200);
}

TEST_F(SecureMetricsTest, UnusableMetricsFlagsStopTheServerNamingThem) {
  int attempt = 0;
  for (const std::vector<std::string>& flags : std::vector<std::vector<std::string>>{
           {"--metrics-tls-cert=" + Path("server.crt")},
           {"--metrics-tls-cert=" + Path("missing.crt"), "--metrics-tls-key=" + Path("server.key")},
           {"--metrics-tls-cert=" + Path("server.crt"), "--metrics-tls-key=" + Path("alice.key")},
           {"--metrics-token-file=" + Path("missing.token")}}) {
    AmpdProcess server(AMPD_SERVER_BINARY, flags,
                       dir_.path() / absl::StrCat("refused", attempt++, ".log"));
    EXPECT_EQ(server.port(), 0) << flags[0];
    EXPECT_TRUE(absl::StrContains(server.Log(), "metrics")) << server.Log();
  }
}

}  // namespace
}  // namespace ampd
