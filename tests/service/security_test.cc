// Transport security and authentication of the real `ampd`: certificates
// made at test time with the openssl tool (a CA, a server certificate for
// 127.0.0.1/localhost, a client certificate of that CA and one of another
// CA), then TLS, mutual TLS and bearer tokens over loopback TCP with
// ampd::Client and ampctl. The tenants file parser and the token check are
// also tested directly.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "reflection_subset.grpc.pb.h"
#include "server/rpc/auth.h"
#include "tests/support/ampd_process.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::ExitStatus;
using test_support::HttpGetBody;
using test_support::ReadFile;
using test_support::RunCommand;
using test_support::TempDir;

constexpr auto kCommandDeadline = std::chrono::seconds(60);

// Makes the certificates under `dir`: ca.{crt,key}, other-ca.{crt,key},
// server.{crt,key} (signed by ca, SANs 127.0.0.1 and localhost),
// server2.{crt,key} (the same, signed by other-ca: a rotated certificate),
// client.{crt,key} (signed by ca), rogue.{crt,key} (signed by other-ca), and
// alice, carol and dave.{crt,key} (signed by ca, the subject's CN their
// name: client certificates that name a tenant, or no tenant for carol), and
// service.{crt,key} (signed by ca, naming only DNS:ampd.internal, as a
// cluster service's certificate would), and expired.{crt,key} (signed by
// ca, its validity over a day before it was made).
// EC keys: generated in milliseconds.
constexpr char kMakeCertificates[] = R"(set -e
cd "$1"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key"; }
ca() {
  key "$1"
  openssl req -x509 -new -key "$1.key" -out "$1.crt" -days 2 -subj "/CN=$1" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
}
leaf() {  # name, signing CA, extensions
  key "$1"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.crt"
}
ca ca
ca other-ca
leaf server ca "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
leaf server2 other-ca "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
leaf client ca "extendedKeyUsage=clientAuth"
leaf rogue other-ca "extendedKeyUsage=clientAuth"
leaf alice ca "extendedKeyUsage=clientAuth"
leaf carol ca "extendedKeyUsage=clientAuth"
leaf dave ca "extendedKeyUsage=clientAuth"
leaf service ca "subjectAltName=DNS:ampd.internal
extendedKeyUsage=serverAuth"
# expired: signed by ca, valid until a day before it was made.
key expired
openssl req -new -key expired.key -out expired.csr -subj "/CN=expired"
openssl x509 -req -in expired.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days -1 \
  -extfile client.ext -out expired.crt
)";

// Tokens of the tenants file (only their SHA-256, computed by sha256sum,
// is written to it).
constexpr char kAliceToken[] = "alice-token-4f1c2e";
constexpr char kBobToken[] = "bob-token-9a7d00";

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new TempDir("ampd_security_certs");
    const CommandResult made = RunCommand(
        {"/bin/sh", "-c", kMakeCertificates, "make-certificates", Path("")}, kCommandDeadline);
    ASSERT_EQ(made.status.code, 0)
        << "making certificates with openssl failed (" << made.status.ToString() << "):\n"
        << made.err;
  }
  static void TearDownTestSuite() {
    delete certs_;
    certs_ = nullptr;
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr)
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
  }

  static std::string Path(const std::string& name) { return (certs_->path() / name).string(); }

  static std::string Sha256Hex(const std::string& token) {
    const CommandResult sum = RunCommand({"/usr/bin/sha256sum"}, kCommandDeadline, token);
    EXPECT_EQ(sum.status.code, 0) << sum.err;
    return sum.out.substr(0, 64);
  }

  // A tenants file with alice (quotas given) and bob.
  std::string WriteTenants() {
    const std::string path = (dir_.path() / "tenants").string();
    std::ofstream(path) << "# tenants of the test\n"
                        << "alice " << Sha256Hex(kAliceToken) << " max_jobs=4\n\n"
                        << "bob   " << Sha256Hex(kBobToken) << "  # no quotas\n";
    return path;
  }

  void Start(const std::vector<std::string>& flags) {
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags,
                                            (dir_.path() / "ampd.log").string());
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
  }

  std::vector<std::string> TlsFlags(bool mutual) const {
    std::vector<std::string> flags = {"--tls-cert=" + Path("server.crt"),
                                      "--tls-key=" + Path("server.key")};
    if (mutual) flags.push_back("--tls-client-ca=" + Path("ca.crt"));
    return flags;
  }

  // A client that tries once, briefly: refusals are expected to be quick.
  std::unique_ptr<Client> Connect(const std::string& ca, const std::string& cert,
                                  const std::string& token = "") const {
    ClientOptions options;
    options.deadline = absl::Seconds(20);
    options.max_attempts = 1;
    options.token = token;
    const absl::Status loaded =
        LoadTlsFiles(ca.empty() ? "" : Path(ca), cert.empty() ? "" : Path(cert + ".crt"),
                     cert.empty() ? "" : Path(cert + ".key"), options);
    EXPECT_TRUE(loaded.ok()) << loaded;
    return Client::Connect(server_->address(), options);
  }

  static v1::CreateJobRequest JobRequest() {
    SyntheticTaskOptions task_options;
    task_options.batch_size = 8;
    SyntheticTask task(task_options);
    v1::CreateJobRequest request;
    *request.mutable_config()->mutable_model() = task.Model();
    request.mutable_config()->set_precision(v1::PRECISION_FP16);
    request.mutable_config()->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    return request;
  }

  // Creates a job and trains it one step; the job id.
  static std::string Train(Client& client) {
    absl::StatusOr<v1::Job> job = client.CreateJob(JobRequest());
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return "";
    SyntheticTaskOptions task_options;
    task_options.batch_size = 8;
    SyntheticTask task(task_options);
    v1::StepRequest step;
    step.set_job_id(job->job_id());
    step.set_sequence(1);
    *step.add_micro_batches() = task.NextBatch();
    absl::StatusOr<v1::StepResponse> stepped = client.Step(step);
    EXPECT_TRUE(stepped.ok()) << stepped.status();
    if (stepped.ok()) {
      EXPECT_EQ(stepped->global_step(), 1);
    }
    return job->job_id();
  }

  static void ExpectUnauthenticated(const absl::Status& status) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
    std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(status);
    ASSERT_TRUE(info.has_value()) << status;
    EXPECT_EQ(info->reason(), "UNAUTHENTICATED");
    EXPECT_EQ(info->domain(), "ampd");
  }

  static bool Serving(Client& client) {
    absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> status = client.Health();
    return status.ok() && *status == grpc::health::v1::HealthCheckResponse::SERVING;
  }

  // Asks server reflection for the service list, unauthenticated; the
  // stream's final status (a served list must name some service).
  static grpc::Status ListServices(Client& client) {
    auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(client.channel());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = reflection->ServerReflectionInfo(&context);
    grpc::reflection::v1alpha::ServerReflectionRequest request;
    request.set_list_services("");
    stream->Write(request);
    stream->WritesDone();
    grpc::reflection::v1alpha::ServerReflectionResponse response;
    const bool read = stream->Read(&response);
    const grpc::Status finished = stream->Finish();
    if (finished.ok() && (!read || response.list_services_response().service_size() == 0)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "reflection listed no service");
    }
    return finished;
  }

  // Starts ampd with each case's flags: it must exit 1 before listening,
  // its log naming the case's expected text.
  void ExpectEachStartFails(
      const std::vector<std::pair<std::vector<std::string>, std::string>>& cases) {
    int i = 0;
    for (const auto& [flags, expected] : cases) {
      SCOPED_TRACE(expected);
      const std::filesystem::path log = dir_.path() / absl::StrCat("ampd-", i++, ".log");
      AmpdProcess server(AMPD_SERVER_BINARY, flags, log);
      EXPECT_EQ(server.port(), 0);
      const ExitStatus exit = server.Wait(kCommandDeadline);
      EXPECT_TRUE(exit.exited && exit.code == 1) << exit.ToString();
      EXPECT_TRUE(absl::StrContains(server.Log(), expected)) << server.Log();
    }
  }

  static TempDir* certs_;
  TempDir dir_{"ampd_security"};
  std::unique_ptr<AmpdProcess> server_;
};

TempDir* SecurityTest::certs_ = nullptr;

TEST_F(SecurityTest, TlsServesTrainingAndRefusesPlaintext) {
  Start(TlsFlags(/*mutual=*/false));
  std::unique_ptr<Client> tls = Connect("ca.crt", "");
  EXPECT_TRUE(Serving(*tls));
  EXPECT_FALSE(Train(*tls).empty());

  std::unique_ptr<Client> plaintext = Connect("", "");
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = plaintext->Health();
  EXPECT_EQ(health.status().code(), absl::StatusCode::kUnavailable) << health.status();
  EXPECT_FALSE(plaintext->CreateJob(JobRequest()).ok());

  // A client that trusts another CA refuses the server's certificate.
  EXPECT_FALSE(Serving(*Connect("other-ca.crt", "")));
  EXPECT_TRUE(absl::StrContains(server_->Log(), "(TLS, open)")) << server_->Log();
}

TEST_F(SecurityTest, RotatedCertificateFilesApplyWithoutARestart) {
  const std::filesystem::path cert = dir_.path() / "live.crt";
  const std::filesystem::path key = dir_.path() / "live.key";
  std::filesystem::copy_file(Path("server.crt"), cert);
  std::filesystem::copy_file(Path("server.key"), key);
  Start({"--tls-cert=" + cert.string(), "--tls-key=" + key.string(), "--tls-reload-interval-s=1"});
  ASSERT_TRUE(Serving(*Connect("ca.crt", "")));
  ASSERT_FALSE(Serving(*Connect("other-ca.crt", "")));

  // Replaced by renames, as a certificate manager does, so the watcher never
  // reads half a file.
  std::filesystem::copy_file(Path("server2.key"), dir_.path() / "next.key");
  std::filesystem::copy_file(Path("server2.crt"), dir_.path() / "next.crt");
  std::filesystem::rename(dir_.path() / "next.key", key);
  std::filesystem::rename(dir_.path() / "next.crt", cert);
  // Each Connect is a new channel, so a new handshake; bounded wait for the
  // watcher's next read (every second).
  bool rotated = false;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       !rotated && absl::Now() < deadline; absl::SleepFor(absl::Milliseconds(200))) {
    rotated = Serving(*Connect("other-ca.crt", ""));
  }
  EXPECT_TRUE(rotated) << "the server still presents the old certificate";
  EXPECT_FALSE(Serving(*Connect("ca.crt", "")));
  EXPECT_EQ(server_->Terminate(kCommandDeadline).code, 0);
}

TEST_F(SecurityTest, MutualTlsRefusesMissingForeignOrExpiredClientCertificates) {
  Start(TlsFlags(/*mutual=*/true));
  std::unique_ptr<Client> good = Connect("ca.crt", "client");
  EXPECT_TRUE(Serving(*good));
  EXPECT_FALSE(Train(*good).empty());

  for (const std::string cert : {"", "rogue", "expired"}) {
    SCOPED_TRACE(cert.empty() ? "no client certificate" : cert);
    std::unique_ptr<Client> refused = Connect("ca.crt", cert);
    absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = refused->Health();
    EXPECT_EQ(health.status().code(), absl::StatusCode::kUnavailable) << health.status();
    EXPECT_FALSE(refused->CreateJob(JobRequest()).ok());
  }
  std::unique_ptr<Client> plaintext = Connect("", "");
  EXPECT_FALSE(Serving(*plaintext));
}

TEST_F(SecurityTest, TokensGateEveryTrainerCallButNotHealth) {
  Start({"--auth-tokens=" + WriteTenants()});

  std::unique_ptr<Client> anonymous = Connect("", "");
  // Probes and reflection need no token.
  EXPECT_TRUE(Serving(*anonymous));
  const grpc::Status reflected = ListServices(*anonymous);
  EXPECT_TRUE(reflected.ok()) << reflected.error_message();
  ExpectUnauthenticated(anonymous->CreateJob(JobRequest()).status());
  ExpectUnauthenticated(anonymous->ListJobs(0, "").status());
  ExpectUnauthenticated(anonymous->GetJob("job-1").status());
  ExpectUnauthenticated(anonymous->DeleteJob("job-1"));
  ExpectUnauthenticated(anonymous->GetStateDict("job-1").status());
  ExpectUnauthenticated(anonymous->LoadStateDict("job-1", "not a file").status());

  std::unique_ptr<Client> wrong = Connect("", "", "alice-token-4f1c2f");
  ExpectUnauthenticated(wrong->CreateJob(JobRequest()).status());
  ExpectUnauthenticated(wrong->Step(v1::StepRequest()).status());
  ExpectUnauthenticated(wrong->Evaluate(v1::EvaluateRequest()).status());

  // The digest of a token is not a token.
  std::unique_ptr<Client> digest = Connect("", "", Sha256Hex(kAliceToken));
  ExpectUnauthenticated(digest->ListJobs(0, "").status());

  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  const std::string job = Train(*alice);
  ASSERT_FALSE(job.empty());
  absl::StatusOr<std::string> state = alice->GetStateDict(job);
  EXPECT_TRUE(state.ok()) << state.status();
  // bob's token passes too; alice's job is not his to see.
  std::unique_ptr<Client> bob = Connect("", "", kBobToken);
  EXPECT_TRUE(bob->ListJobs(0, "").ok());
  EXPECT_EQ(bob->GetJob(job).status().code(), absl::StatusCode::kNotFound);

  // A malformed authorization value is refused like a missing one.
  grpc::ClientContext context;
  context.AddMetadata("authorization", std::string("Basic ") + kAliceToken);
  v1::ListJobsResponse response;
  const grpc::Status basic = alice->stub().ListJobs(&context, v1::ListJobsRequest(), &response);
  EXPECT_EQ(basic.error_code(), grpc::StatusCode::UNAUTHENTICATED) << basic.error_message();
  EXPECT_TRUE(absl::StrContains(server_->Log(), "tokens travel in clear")) << server_->Log();
}

// Another tenant's job answers exactly as a job that does not exist.
void ExpectNoJob(const absl::Status& status, const std::string& job_id) {
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_EQ(status.message(), absl::StrCat("job_id: no job '", job_id, "'"));
  std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(status);
  ASSERT_TRUE(info.has_value()) << status;
  EXPECT_EQ(info->reason(), "JOB_NOT_FOUND");
}

TEST_F(SecurityTest, ATenantCannotReachAnotherTenantsJobsAndOwnershipSurvivesARestart) {
  const std::vector<std::string> flags = {"--auth-tokens=" + WriteTenants(),
                                          "--state-dir=" + (dir_.path() / "state").string()};
  Start(flags);
  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  std::unique_ptr<Client> bob = Connect("", "", kBobToken);
  const std::string job = Train(*alice);
  ASSERT_FALSE(job.empty());
  absl::StatusOr<std::string> state = alice->GetStateDict(job);
  ASSERT_TRUE(state.ok()) << state.status();

  const auto bob_cannot_reach = [&] {
    ExpectNoJob(bob->GetJob(job).status(), job);
    v1::StepRequest step;
    step.set_job_id(job);
    step.set_sequence(2);
    SyntheticTaskOptions task_options;
    task_options.batch_size = 8;
    *step.add_micro_batches() = SyntheticTask(task_options).NextBatch();
    ExpectNoJob(bob->Step(step).status(), job);
    v1::EvaluateRequest evaluate;
    evaluate.set_job_id(job);
    *evaluate.add_micro_batches() = step.micro_batches(0);
    ExpectNoJob(bob->Evaluate(evaluate).status(), job);
    ExpectNoJob(bob->GetStateDict(job).status(), job);
    ExpectNoJob(bob->LoadStateDict(job, *state).status(), job);
    ExpectNoJob(bob->DeleteJob(job), job);
    absl::StatusOr<std::vector<v1::Job>> listed = bob->ListAllJobs();
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_TRUE(listed->empty());
    // Untouched by all of that: still alice's, at step 1.
    absl::StatusOr<v1::Job> own = alice->GetJob(job);
    ASSERT_TRUE(own.ok()) << own.status();
    EXPECT_EQ(own->step(), 1);
    absl::StatusOr<std::vector<v1::Job>> alices = alice->ListAllJobs();
    ASSERT_TRUE(alices.ok()) << alices.status();
    ASSERT_EQ(alices->size(), 1u);
    EXPECT_EQ((*alices)[0].job_id(), job);
  };
  // The job's series name its tenant, before and after the restart; no
  // token ever appears in the exposition.
  const auto series_name_alice = [&] {
    absl::StatusOr<std::string> text = HttpGetBody(server_->metrics_port(), "/metrics");
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_TRUE(absl::StrContains(
        *text, absl::StrCat("ampd_loss_scale{job=\"", job, "\",tenant=\"alice\"}")))
        << *text;
    EXPECT_FALSE(absl::StrContains(*text, kAliceToken));
    EXPECT_FALSE(absl::StrContains(*text, "bob"));
  };
  bob_cannot_reach();
  series_name_alice();
  // The owner is in the checkpoint: a restart restores it with the job.
  ASSERT_EQ(server_->Terminate(std::chrono::seconds(60)).code, 0) << server_->Describe();
  Start(flags);
  alice = Connect("", "", kAliceToken);
  bob = Connect("", "", kBobToken);
  bob_cannot_reach();
  v1::StepRequest second;
  second.set_job_id(job);
  second.set_sequence(2);
  SyntheticTaskOptions task_options;
  task_options.batch_size = 8;
  *second.add_micro_batches() = SyntheticTask(task_options).NextBatch();
  ASSERT_TRUE(alice->Step(second).ok());
  series_name_alice();
  EXPECT_TRUE(alice->DeleteJob(job).ok());
}

TEST_F(SecurityTest, RequestIdsAreDeduplicatedPerTenant) {
  Start({"--auth-tokens=" + WriteTenants()});
  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  std::unique_ptr<Client> bob = Connect("", "", kBobToken);
  v1::CreateJobRequest request = JobRequest();
  request.set_request_id("create-once");
  absl::StatusOr<v1::Job> a = alice->CreateJob(request);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<v1::Job> b = bob->CreateJob(request);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(a->job_id(), b->job_id());
  // Each tenant's retry still finds its own job.
  absl::StatusOr<v1::Job> again = bob->CreateJob(request);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job_id(), b->job_id());
  absl::StatusOr<std::vector<v1::Job>> listed = bob->ListAllJobs();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].job_id(), b->job_id());
}

TEST_F(SecurityTest, TenantQuotasHoldBesideTheServerWideLimits) {
  // alice may hold one job; bob's jobs may hold fewer bytes than one job
  // needs; carol has no quota.
  const std::string path = (dir_.path() / "quota-tenants").string();
  std::ofstream(path) << "alice " << Sha256Hex(kAliceToken) << " max_jobs=1\n"
                      << "bob " << Sha256Hex(kBobToken) << " max_memory_bytes=1000\n"
                      << "carol " << Sha256Hex("carol-token") << "\n";
  Start({"--auth-tokens=" + path});
  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  std::unique_ptr<Client> bob = Connect("", "", kBobToken);
  std::unique_ptr<Client> carol = Connect("", "", "carol-token");

  const std::string first = Train(*alice);
  ASSERT_FALSE(first.empty());
  absl::Status refused = alice->CreateJob(JobRequest()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(refused);
  ASSERT_TRUE(info.has_value()) << refused;
  EXPECT_EQ(info->reason(), "JOB_LIMIT");
  EXPECT_EQ(info->metadata().at("tenant"), "alice");
  EXPECT_EQ(info->metadata().at("max_jobs"), "1");
  // Only alice is held back.
  EXPECT_FALSE(Train(*carol).empty());
  EXPECT_FALSE(Train(*carol).empty());
  // A deleted job frees alice's place.
  ASSERT_TRUE(alice->DeleteJob(first).ok());
  EXPECT_FALSE(Train(*alice).empty());

  refused = bob->CreateJob(JobRequest()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  info = ErrorInfoOf(refused);
  ASSERT_TRUE(info.has_value()) << refused;
  EXPECT_EQ(info->reason(), "MEMORY_LIMIT");
  EXPECT_EQ(info->metadata().at("tenant"), "bob");
  EXPECT_EQ(info->metadata().at("limit_bytes"), "1000");
  absl::StatusOr<std::vector<v1::Job>> bobs = bob->ListAllJobs();
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->empty());
}

// Quotas hold at restore too: a tenant whose quota shrank over a restart
// gets back only as many jobs as it allows (the most recently written); the others stay on disk,
// logged, and come back once the quota allows them. Other tenants' jobs are unaffected.
TEST_F(SecurityTest, TenantQuotasHoldWhenJobsAreRestored) {
  const std::string state_dir = (dir_.path() / "state").string();
  const std::string path = (dir_.path() / "restore-tenants").string();
  const auto write_tenants = [&](int alice_max_jobs) {
    std::ofstream(path) << "alice " << Sha256Hex(kAliceToken) << " max_jobs=" << alice_max_jobs
                        << "\n"
                        << "bob " << Sha256Hex(kBobToken) << "\n";
  };
  write_tenants(3);
  const std::vector<std::string> flags = {"--auth-tokens=" + path, "--state-dir=" + state_dir};
  Start(flags);
  std::vector<std::string> alices;
  for (int i = 0; i < 3; ++i) {
    alices.push_back(Train(*Connect("", "", kAliceToken)));
    ASSERT_FALSE(alices.back().empty());
  }
  const std::string bobs = Train(*Connect("", "", kBobToken));
  ASSERT_FALSE(bobs.empty());
  ASSERT_EQ(server_->Terminate(std::chrono::seconds(60)).code, 0) << server_->Describe();

  write_tenants(1);
  Start(flags);
  absl::StatusOr<std::vector<v1::Job>> restored = Connect("", "", kAliceToken)->ListAllJobs();
  ASSERT_TRUE(restored.ok()) << restored.status();
  // Which one is the most recently written checkpoint's (SIGTERM writes
  // them all, in parallel); the other two stay behind.
  ASSERT_EQ(restored->size(), 1u);
  EXPECT_TRUE(absl::c_linear_search(alices, (*restored)[0].job_id()));
  EXPECT_TRUE(Connect("", "", kBobToken)->GetJob(bobs).ok());
  for (const std::string& job : alices) {
    if (job == (*restored)[0].job_id()) continue;
    EXPECT_TRUE(absl::StrContains(server_->Log(), absl::StrCat("job ", job, " not restored")))
        << server_->Log();
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(state_dir) / (job + ".safetensors")))
        << job;
  }
  ASSERT_EQ(server_->Terminate(std::chrono::seconds(60)).code, 0) << server_->Describe();

  // With room again, every job is back, at the step it had.
  write_tenants(3);
  Start(flags);
  restored = Connect("", "", kAliceToken)->ListAllJobs();
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->size(), 3u);
  for (const v1::Job& job : *restored) EXPECT_EQ(job.step(), 1) << job.job_id();
}

// A refusal against a server-wide limit tells the caller the limit and its
// own usage, never what other tenants hold: with --max-memory-bytes a
// refused CreateJob, Step or Sample once said how many bytes all jobs
// held (it rose by exactly the size of another tenant's new job), and with
// --max-state-dict-buffer-bytes a refused upload said how many bytes the
// other uploads in progress held. Bob's refusals now read the same before
// and after Alice creates a job and holds an upload open.
TEST_F(SecurityTest, RefusalsNameOnlyTheCallersOwnUsage) {
  Start({"--auth-tokens=" + WriteTenants(), "--max-memory-bytes=" + std::to_string(32 << 20),
         "--max-state-dict-buffer-bytes=1000000"});
  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  std::unique_ptr<Client> bob = Connect("", "", kBobToken);

  // Bob's job: wide enough that a batch of 4096 rows needs far more than
  // the limit for its activations, small enough in weights to be admitted.
  SyntheticTaskOptions wide_options;
  wide_options.hidden = 4096;
  wide_options.batch_size = 4096;
  SyntheticTask wide(wide_options);
  v1::CreateJobRequest bob_request = JobRequest();
  *bob_request.mutable_config()->mutable_model() = wide.Model();
  absl::StatusOr<v1::Job> bob_job = bob->CreateJob(bob_request);
  ASSERT_TRUE(bob_job.ok()) << bob_job.status();
  // A GPT of Bob's whose Sample of 4096 sequences needs far more than the
  // limit for its caches.
  v1::CreateJobRequest gpt_request;
  v1::Gpt* gpt = gpt_request.mutable_config()->mutable_model()->mutable_gpt();
  gpt->set_vocab_size(64);
  gpt->set_context_length(256);
  gpt->set_d_model(32);
  gpt->set_n_layer(2);
  gpt->set_n_head(4);
  gpt_request.mutable_config()->set_precision(v1::PRECISION_FP32);
  absl::StatusOr<v1::Job> bob_gpt = bob->CreateJob(gpt_request);
  ASSERT_TRUE(bob_gpt.ok()) << bob_gpt.status();

  v1::CreateJobRequest too_big = JobRequest();
  SyntheticTaskOptions huge_options;
  huge_options.hidden = int64_t{1} << 20;
  *too_big.mutable_config()->mutable_model() = SyntheticTask(huge_options).Model();
  v1::StepRequest step;
  step.set_job_id(bob_job->job_id());
  step.set_sequence(1);
  *step.add_micro_batches() = wide.NextBatch();
  v1::SampleRequest sample;
  sample.set_job_id(bob_gpt->job_id());
  for (int p = 0; p < 16; ++p) sample.add_prompts()->add_tokens(p + 1);
  sample.set_num_samples(256);
  sample.set_max_tokens(200);
  auto sample_refusal = [&]() -> std::string {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kBobToken);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::SampleResponse response;
    const grpc::Status s = bob->stub().Sample(&context, sample, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    return s.error_message();
  };
  // A state dict of one 4 MB tensor: more than the whole upload buffer.
  codec::StateDict oversized;
  oversized.tensors.push_back(
      {"model.0.weight", {codec::DType::kF32, {1000000}, std::string(4000000, 'x')}});
  const std::string oversized_file = codec::EncodeSafetensors(oversized);
  auto refusal = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(s);
    EXPECT_TRUE(info.has_value() && info->reason() == "MEMORY_LIMIT") << s;
    return std::string(s.message());
  };
  struct Refusals {
    std::string create, step, sample, load;
  };
  auto refusals = [&]() {
    Refusals r;
    r.create = refusal(bob->CreateJob(too_big).status());
    r.step = refusal(bob->Step(step).status());
    r.sample = sample_refusal();
    r.load = refusal(bob->LoadStateDict(bob_job->job_id(), oversized_file).status());
    return r;
  };
  const Refusals alone = refusals();

  // Alice creates a job, and holds an upload of a 600 KB tensor open.
  absl::StatusOr<v1::Job> alice_job = alice->CreateJob(JobRequest());
  ASSERT_TRUE(alice_job.ok()) << alice_job.status();
  codec::StateDict held;
  held.tensors.push_back(
      {"model.0.weight", {codec::DType::kF32, {150000}, std::string(600000, 'x')}});
  const std::string held_file = codec::EncodeSafetensors(held);
  struct Upload {
    grpc::ClientContext context;
    v1::LoadStateDictResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer;
  };
  v1::LoadStateDictRequest chunk;
  chunk.set_job_id(alice_job->job_id());
  chunk.set_data(held_file.substr(0, held_file.size() - 100000));
  // Her bytes are held once an upload of Bob's of the same size no longer
  // fits beside them. The server reads her chunk when it comes to it: if
  // one of his uploads held its bytes just then, hers is the one refused,
  // and she opens another.
  std::unique_ptr<Upload> upload;
  std::string beside;
  for (int attempt = 0; attempt < 20 && beside.empty(); ++attempt) {
    if (upload != nullptr) {
      upload->writer->WritesDone();
      upload->writer->Finish();
    }
    upload = std::make_unique<Upload>();
    upload->context.AddMetadata("authorization", std::string("Bearer ") + kAliceToken);
    upload->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    upload->writer = alice->stub().LoadStateDict(&upload->context, &upload->response);
    ASSERT_TRUE(upload->writer->Write(chunk));
    absl::SleepFor(absl::Milliseconds(200));
    for (int probe = 0; probe < 10 && beside.empty(); ++probe) {
      const absl::Status s = bob->LoadStateDict(bob_job->job_id(), held_file).status();
      if (s.code() == absl::StatusCode::kResourceExhausted) {
        beside = std::string(s.message());
      } else {
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
  }
  ASSERT_FALSE(beside.empty()) << "Alice's upload never held its bytes";
  EXPECT_FALSE(absl::StrContains(beside, absl::StrCat(held_file.size()))) << beside;

  const Refusals besides_alice = refusals();
  EXPECT_EQ(besides_alice.create, alone.create);
  EXPECT_EQ(besides_alice.step, alone.step);
  EXPECT_EQ(besides_alice.sample, alone.sample);
  EXPECT_EQ(besides_alice.load, alone.load);
  upload->writer->WritesDone();
  upload->writer->Finish();
}

TEST_F(SecurityTest, AmpctlTrainsOverMutualTlsWithATokenFromTheEnvironment) {
  std::vector<std::string> flags = TlsFlags(/*mutual=*/true);
  flags.push_back("--auth-tokens=" + WriteTenants());
  Start(flags);
  const std::string ampctl =
      absl::StrCat(AMPCTL_BINARY, " --server=", server_->address(), " --tls-ca=", Path("ca.crt"),
                   " --tls-cert=", Path("client.crt"), " --tls-key=", Path("client.key"));
  const CommandResult trained = RunCommand(
      {"/bin/sh", "-c", absl::StrCat("AMPD_TOKEN=", kBobToken, " ", ampctl, " train --steps=2")},
      kCommandDeadline);
  EXPECT_EQ(trained.status.code, 0) << trained.out << trained.err;

  const CommandResult refused =
      RunCommand({"/bin/sh", "-c", absl::StrCat("unset AMPD_TOKEN; ", ampctl, " jobs list")},
                 kCommandDeadline);
  EXPECT_EQ(refused.status.code, 1);
  EXPECT_TRUE(absl::StrContains(refused.err, "UNAUTHENTICATED")) << refused.err;
}

// With --tenant-from-client-cert, a verified certificate's common name is
// the tenant: alice calls with her certificate alone, dave (listed with "-")
// has no token at all, and a certificate never carries another tenant's
// token.
TEST_F(SecurityTest, AClientCertificateCanNameTheTenant) {
  const std::string path = (dir_.path() / "tenants").string();
  std::ofstream(path) << "alice " << Sha256Hex(kAliceToken) << "\n"
                      << "bob " << Sha256Hex(kBobToken) << "\n"
                      << "dave -  # certificate only\n";
  std::vector<std::string> flags = TlsFlags(/*mutual=*/true);
  flags.push_back("--auth-tokens=" + path);
  flags.push_back("--tenant-from-client-cert");
  Start(flags);

  std::unique_ptr<Client> alice_by_cert = Connect("ca.crt", "alice");
  const std::string job = Train(*alice_by_cert);
  ASSERT_FALSE(job.empty());
  // The same tenant as alice's token (through a certificate naming nobody).
  std::unique_ptr<Client> alice_by_token = Connect("ca.crt", "carol", kAliceToken);
  absl::StatusOr<v1::Job> seen = alice_by_token->GetJob(job);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->step(), 1);
  // bob's token through a certificate naming nobody is bob, who sees nothing.
  std::unique_ptr<Client> bob = Connect("ca.crt", "carol", kBobToken);
  ExpectNoJob(bob->GetJob(job).status(), job);

  std::unique_ptr<Client> dave = Connect("ca.crt", "dave");
  EXPECT_FALSE(Train(*dave).empty());
  absl::StatusOr<std::vector<v1::Job>> daves = dave->ListAllJobs();
  ASSERT_TRUE(daves.ok()) << daves.status();
  EXPECT_EQ(daves->size(), 1u);

  // A certificate naming no tenant, with no token: refused.
  ExpectUnauthenticated(Connect("ca.crt", "carol")->ListJobs(0, "").status());
  // alice's certificate with bob's token: refused, whoever holds both.
  ExpectUnauthenticated(Connect("ca.crt", "alice", kBobToken)->GetJob(job).status());
  // dave has no token: nothing typed after "Bearer" is his.
  ExpectUnauthenticated(Connect("ca.crt", "carol", "-")->ListJobs(0, "").status());
}

TEST_F(SecurityTest, CertificateNamedTenantsNeedMutualTlsAndTheFlag) {
  const std::string path = (dir_.path() / "tenants").string();
  std::ofstream(path) << "alice " << Sha256Hex(kAliceToken) << "\ndave -\n";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--auth-tokens=" + path, "--tenant-from-client-cert"},
       "--tenant-from-client-cert needs --auth-tokens and --tls-client-ca"},
      {{"--auth-tokens=" + path}, "tenant 'dave' has no token"}};
  ExpectEachStartFails(cases);
}

// The deployment's health probe: ampctl inside the pod dials 127.0.0.1, and
// the server's certificate names only the service, so the probe says which
// name to verify; with mutual TLS it shows its own certificate, no token.
TEST_F(SecurityTest, ALoopbackProbeVerifiesTheServicesCertificateByName) {
  Start({"--tls-cert=" + Path("service.crt"), "--tls-key=" + Path("service.key"),
         "--tls-client-ca=" + Path("ca.crt"), "--auth-tokens=" + WriteTenants()});
  const std::string probe =
      absl::StrCat(AMPCTL_BINARY, " --server=127.0.0.1:", server_->port(),
                   " --tls-ca=", Path("ca.crt"), " --tls-cert=", Path("client.crt"),
                   " --tls-key=", Path("client.key"), " --deadline-ms=10000");
  const CommandResult named = RunCommand(
      {"/bin/sh", "-c", probe + " --tls-server-name=ampd.internal health"}, kCommandDeadline);
  EXPECT_EQ(named.status.code, 0) << named.out << named.err;
  EXPECT_TRUE(absl::StrContains(named.out, "SERVING")) << named.out;
  // Without the name the certificate does not match 127.0.0.1.
  const CommandResult unnamed = RunCommand({"/bin/sh", "-c", probe + " health"}, kCommandDeadline);
  EXPECT_NE(unnamed.status.code, 0) << unnamed.out;
  // Nor does another name.
  const CommandResult wrong = RunCommand(
      {"/bin/sh", "-c", probe + " --tls-server-name=other.internal health"}, kCommandDeadline);
  EXPECT_NE(wrong.status.code, 0) << wrong.out;
  // A name without TLS is a usage error.
  const CommandResult usage =
      RunCommand({"/bin/sh", "-c",
                  absl::StrCat(AMPCTL_BINARY, " --server=127.0.0.1:1 --tls-server-name=x health")},
                 kCommandDeadline);
  EXPECT_EQ(usage.status.code, 2);
  EXPECT_TRUE(absl::StrContains(usage.err, "--tls-server-name needs --tls-ca")) << usage.err;
}

TEST_F(SecurityTest, ReflectionCanBeTurnedOffAndProbesStayOpen) {
  Start({"--auth-tokens=" + WriteTenants(), "--reflection=false"});
  std::unique_ptr<Client> anonymous = Connect("", "");
  EXPECT_TRUE(Serving(*anonymous));
  const grpc::Status reflected = ListServices(*anonymous);
  EXPECT_EQ(reflected.error_code(), grpc::StatusCode::UNIMPLEMENTED) << reflected.error_message();
  // Training is unaffected.
  std::unique_ptr<Client> alice = Connect("", "", kAliceToken);
  EXPECT_FALSE(Train(*alice).empty());
}

TEST_F(SecurityTest, OpenServerWarnsAtStart) {
  Start({});
  EXPECT_TRUE(absl::StrContains(server_->Log(), "WARNING: no --auth-tokens")) << server_->Log();
  EXPECT_TRUE(Serving(*Connect("", "")));
}

TEST_F(SecurityTest, MalformedTokensFileStopsTheServerNamingTheLine) {
  const std::string path = (dir_.path() / "tenants").string();
  std::ofstream(path) << "# ok so far\nalice " << Sha256Hex(kAliceToken) << "\n"
                      << "bob " << Sha256Hex(kBobToken) << " max_jobs=lots\n";
  server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY,
                                          std::vector<std::string>{"--auth-tokens=" + path},
                                          (dir_.path() / "ampd.log").string());
  EXPECT_EQ(server_->port(), 0);
  const ExitStatus exit = server_->Wait(kCommandDeadline);
  EXPECT_TRUE(exit.exited && exit.code == 1) << exit.ToString();
  EXPECT_TRUE(absl::StrContains(server_->Log(), "line 3: max_jobs")) << server_->Log();
}

TEST_F(SecurityTest, TlsFlagsAreCheckedAtStart) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--tls-cert=" + Path("server.crt")}, "--tls-cert and --tls-key go together"},
      {{"--tls-client-ca=" + Path("ca.crt")}, "--tls-client-ca needs --tls-cert"},
      {{"--tls-cert=" + Path("server.crt"), "--tls-key=" + Path("missing.key")},
       "missing.key: cannot open"},
      {{"--tls-cert=" + Path("server.ext"), "--tls-key=" + Path("server.key")},
       "server.ext: not a PEM file"}};
  ExpectEachStartFails(cases);
}

// The parser and the token check without a server.

TEST(TenantsFileTest, ParsesTenantsQuotasAndComments) {
  const std::string alice(64, 'a');
  const std::string bob = absl::AsciiStrToUpper(std::string(64, 'b'));
  absl::StatusOr<std::vector<rpc::Tenant>> tenants = rpc::ParseTenants(
      absl::StrCat("# header\n\n  alice ", alice,
                   " max_memory_bytes=1048576 max_jobs=3  # trailing\r\n", "bob\t", bob, "\n"));
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  ASSERT_EQ(tenants->size(), 2u);
  EXPECT_EQ((*tenants)[0].name, "alice");
  EXPECT_EQ((*tenants)[0].max_jobs, 3);
  EXPECT_EQ((*tenants)[0].max_memory_bytes, 1048576);
  EXPECT_EQ((*tenants)[0].token_sha256[0], 0xaa);
  EXPECT_EQ((*tenants)[1].name, "bob");
  EXPECT_EQ((*tenants)[1].max_jobs, 0);
  EXPECT_EQ((*tenants)[1].token_sha256[31], 0xbb);
}

TEST(TenantsFileTest, NamesTheMalformedLine) {
  const std::string d(64, 'a');
  const std::string e(64, 'e');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"alice\n", "line 1: expected"},
      {"# c\nalice abc\n", "line 2: the token digest must be 64 hex digits"},
      {"alice " + std::string(63, 'a') + "g\n", "line 1: the token digest"},
      {"al/ice " + d + "\n", "line 1: tenant name"},
      {std::string(65, 'x') + " " + d + "\n", "line 1: tenant name"},
      {"alice " + d + "\nalice " + e + "\n", "line 2: tenant 'alice' is listed twice"},
      {"alice " + d + "\nbob " + d + "\n", "line 2: this token digest is already"},
      {"alice " + d + " max_jobs=-1\n", "line 1: max_jobs must be an integer >= 0"},
      {"alice " + d + " max_jobs=1 max_jobs=2\n", "line 1: max_jobs is given twice"},
      {"alice " + d + " max_memory_bytes=99999999999999999999\n", "line 1: max_memory_bytes"},
      {"alice " + d + " jobs=1\n", "line 1: unknown field 'jobs=1'"},
      {"# nothing\n\n", "no tenant is listed"},
  };
  for (const auto& [text, expected] : cases) {
    absl::StatusOr<std::vector<rpc::Tenant>> tenants = rpc::ParseTenants(text);
    EXPECT_EQ(tenants.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(tenants.status().message(), expected))
        << text << " -> " << tenants.status();
  }
}

TEST(AuthenticatorTest, ChecksTheBearerTokenAgainstDigests) {
  // The FIPS 180-2 example: SHA-256("abc").
  const rpc::TokenDigest abc = rpc::Sha256("abc");
  EXPECT_EQ(abc[0], 0xba);
  EXPECT_EQ(abc[31], 0xad);
  rpc::Authenticator auth({rpc::Tenant{.name = "alice", .token_sha256 = abc},
                           rpc::Tenant{.name = "bob", .token_sha256 = rpc::Sha256("xyz")}});
  EXPECT_FALSE(auth.open());
  EXPECT_EQ(auth.AuthenticateHeader("Bearer abc").value_or("?"), "alice");
  EXPECT_EQ(auth.AuthenticateHeader("bearer xyz").value_or("?"), "bob");
  for (const char* bad : {"Bearer abd", "Bearer ", "Bearer", "abc", "Basic abc", "Bearer abc "}) {
    EXPECT_EQ(auth.AuthenticateHeader(bad).status().code(), absl::StatusCode::kUnauthenticated)
        << bad;
  }
  EXPECT_EQ(auth.AuthenticateHeader(std::nullopt).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth.AuthenticateHeader("Bearer abc", /*repeated=*/true).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Open: everyone passes, as the empty tenant.
  EXPECT_EQ(rpc::Authenticator().AuthenticateHeader(std::nullopt).value_or("?"), "");
}

TEST(AuthenticatorTest, ACertificateNamesItsTenantOnlyWhenAllowed) {
  absl::StatusOr<std::vector<rpc::Tenant>> tenants =
      rpc::ParseTenants(absl::StrCat("alice ", std::string(64, 'a'), "\ndave - max_jobs=2\n"));
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  ASSERT_EQ(tenants->size(), 2u);
  EXPECT_TRUE((*tenants)[0].has_token);
  EXPECT_FALSE((*tenants)[1].has_token);
  EXPECT_EQ((*tenants)[1].max_jobs, 2);
  // Two tenants without a token are no duplicate digest.
  EXPECT_TRUE(rpc::ParseTenants("dave -\nerin -\n").ok());

  const std::vector<rpc::Tenant> listed = {
      rpc::Tenant{.name = "alice", .token_sha256 = rpc::Sha256("abc")},
      rpc::Tenant{.name = "dave", .has_token = false}};
  const rpc::Authenticator by_cert(listed, /*tenant_from_client_cert=*/true);
  EXPECT_EQ(by_cert.AuthenticateHeader(std::nullopt, false, "alice").value_or("?"), "alice");
  EXPECT_EQ(by_cert.AuthenticateHeader(std::nullopt, false, "dave").value_or("?"), "dave");
  EXPECT_EQ(by_cert.AuthenticateHeader("Bearer abc", false, "carol").value_or("?"), "alice");
  EXPECT_EQ(by_cert.AuthenticateHeader("Bearer abc", false, "alice").value_or("?"), "alice");
  EXPECT_EQ(by_cert.AuthenticateHeader(std::nullopt, false, "carol").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(by_cert.AuthenticateHeader("Bearer abc", false, "dave").status().code(),
            absl::StatusCode::kUnauthenticated);
  // The all-zero digest a tokenless tenant holds matches no token.
  EXPECT_EQ(by_cert.AuthenticateHeader("Bearer -", false, std::nullopt).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Without the option a certificate's name counts for nothing.
  const rpc::Authenticator by_token(listed);
  EXPECT_EQ(by_token.AuthenticateHeader(std::nullopt, false, "alice").status().code(),
            absl::StatusCode::kUnauthenticated);
}

}  // namespace
}  // namespace ampd
