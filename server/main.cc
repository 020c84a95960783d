// ampd: the training server. Flags, wiring (metrics -> registry -> service ->
// gRPC server), restore from --state-dir, and graceful shutdown: SIGTERM or
// SIGINT is taken by a sigwait thread (no work in a signal handler), which
// wakes main; main flips health to NOT_SERVING, drains in-flight calls,
// checkpoints every job and exits 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dashed_flags.h"
#include "common/status_macros.h"
#include "server/engine/dist/rendezvous_table.h"
#include "server/engine/jobs/job_registry.h"
#include "server/metrics/rpc_in_flight.h"
#include "server/metrics/server_metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/peer_client.h"
#include "server/rpc/peer_service.h"
#include "server/rpc/tls.h"
#include "server/rpc/trainer_service.h"
#include "server/rpc/translate.h"

ABSL_FLAG(std::string, listen, "",
          "gRPC address HOST:PORT; port 0 picks a free one (printed as "
          "'ampd: listening on HOST:PORT'). Empty: 0.0.0.0:50051 with --auth-tokens, else "
          "127.0.0.1:50051 (an open server is not exposed unless asked)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus /metrics address HOST:PORT (port 0 picks one; empty disables)");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "PEM certificate chain: serve /metrics over HTTPS (with --metrics-tls-key; read at "
          "start). Prometheus: scheme https and tls_config");
ABSL_FLAG(std::string, metrics_tls_key, "", "PEM private key of --metrics-tls-cert");
ABSL_FLAG(std::string, metrics_token_file, "",
          "File holding the scrape token: /metrics then answers only 'Authorization: Bearer "
          "TOKEN' (401 otherwise). Prometheus: authorization.credentials_file");
ABSL_FLAG(bool, metrics_tenant_labels, true,
          "Label per-job series with the job id and the tenant. false: no tenant label, and the "
          "job label is a pseudonym of the id, so a scraper learns no tenant's names or job ids "
          "(use it on a node tenants share)");
ABSL_FLAG(std::string, models_dir, "",
          "A folder of Hugging Face model folders (config.json + safetensors) that jobs name as "
          "their base_model, relative to it; LoRA jobs on one base share its weights");
ABSL_FLAG(std::string, state_dir, "",
          "Directory of job checkpoints (one safetensors file per job); jobs found there are "
          "restored at start. Empty: no checkpoints");
ABSL_FLAG(std::string, device, "auto", "Backend for new jobs: auto, cpu, cuda or cuda:N");
ABSL_FLAG(int64_t, checkpoint_every, 100,
          "Checkpoint each job every N steps (0: only at shutdown); needs --state-dir. The step "
          "waits only for a host snapshot; the file is written in the background, so a crash "
          "loses the steps after the last finished write (see --checkpoint-sync)");
ABSL_FLAG(bool, checkpoint_sync, false,
          "Write each periodic checkpoint before the step that took it is answered, so every "
          "acknowledged checkpointed step survives a crash, at the cost of the write in the step");
ABSL_FLAG(bool, reflection, true,
          "Serve gRPC server reflection (grpcurl lists and describes the API with it); "
          "--reflection=false turns it off on a server that should not describe itself");
ABSL_FLAG(int64_t, max_jobs, 64, "Most jobs held at once (0: unlimited)");
ABSL_FLAG(int64_t, max_memory_bytes, 0,
          "Most estimated job bytes (weights, grads, optimizer state) held at once (0: unlimited)");
ABSL_FLAG(int64_t, max_receive_message_bytes, 64 << 20,
          "Largest request message accepted; larger ones fail with RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_state_dict_buffer_bytes, 0,
          "Most bytes all LoadStateDict streams together may hold in memory at once; past it a "
          "stream fails with RESOURCE_EXHAUSTED. 0: a quarter of the machine's memory");
ABSL_FLAG(int64_t, grad_histogram_every, 10,
          "Sample the gradient magnitude histogram every N steps (0: never)");
ABSL_FLAG(int32_t, worker_threads, 0,
          "Threads that run jobs' steps (each job in order, jobs in parallel); 0: one per core");
ABSL_FLAG(int64_t, drain_grace_ms, 0,
          "On SIGTERM, report NOT_SERVING this long before refusing new calls, so load "
          "balancers notice");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve gRPC over TLS (with --tls-key). Re-read every "
          "--tls-reload-interval-s");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require a client certificate signed by it (mutual TLS)");
ABSL_FLAG(int32_t, tls_reload_interval_s, 60,
          "How often the --tls-* files are re-read, so rotated ones apply without a restart");
ABSL_FLAG(std::string, auth_tokens, "",
          "Tenants file: 'TENANT SHA256_HEX_OF_TOKEN [max_jobs=N] [max_memory_bytes=N]' a line; "
          "every Trainer call must then send 'authorization: Bearer TOKEN'. Empty: open server");
ABSL_FLAG(bool, tenant_from_client_cert, false,
          "With --tls-client-ca and --auth-tokens: a verified client certificate whose subject "
          "common name is a tenant's name is that tenant, without a token");
ABSL_FLAG(std::string, peer_address, "",
          "HOST:PORT where this ampd meets the other replicas of distributed jobs "
          "(docs/DISTRIBUTED.md): the ampd.v1.Peer rendezvous listens there and the jobs' Gloo "
          "transport binds to HOST, so HOST must be an address the other replicas reach (a pod "
          "IP, not 0.0.0.0). Only the ranks of this ampd's jobs are served there, each call "
          "signed with a key of its job's distributed.secret; keep it cluster-private all the "
          "same (Gloo's traffic is not encrypted). Empty: no distributed jobs");
ABSL_FLAG(int32_t, peer_waits_per_tenant, 96,
          "Most calls the Peer meeting point lets wait at once (of its 192) for the groups of one "
          "tenant, so that one tenant cannot hold every wait while another's group forms; 1..192 "
          "(docs/DISTRIBUTED.md)");
ABSL_FLAG(int32_t, max_distributed_jobs, 4,
          "Most distributed jobs held at once; each has a worker thread of its own");
ABSL_FLAG(int64_t, shutdown_timeout_ms, 30000,
          "On SIGTERM, how long in-flight calls may take to finish before they are cancelled "
          "(Samples are stopped at once, UNAVAILABLE; a cancelled call stops at its next "
          "micro-batch or decode step, applying nothing)");

namespace {

// The Peer service's limits. Its messages are group names, fingerprints,
// proofs and transport addresses of a few hundred bytes (a value at most
// 64 KiB). Its threads outnumber the waits the meeting point allows
// (RendezvousTable::Limits::max_waiters), so calls that do not wait are
// served while every wait is taken.
constexpr int kMaxPeerThreads = 256;
constexpr int kMaxPeerMessageBytes = 80 << 10;

// Drops the reflection plugin from a ServerBuilder. Linking gRPC's
// reflection library registers the plugin with every builder through a
// static initializer, so leaving reflection off takes removing it.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == "proto_server_reflection";
    });
  }
};

// Everything after the last ':' ("127.0.0.1:0" -> "127.0.0.1", "[::]:0" -> "[::]").
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// Step requests carry batches of megabytes that gRPC's threads allocate and
// the job workers free, every step. With glibc's adaptive defaults the
// freed buffers are soon trimmed off the arenas (madvise), so the next
// step's buffer faults its pages in again: page faults and TLB shootdowns
// that every thread of the process shares, once per step and job. Fixed
// thresholds keep buffers below 32 MiB (glibc's largest mmap threshold) in
// the arenas and up to 256 MiB of freed memory mapped per arena; larger
// buffers (state dicts) are still mmapped and unmapped at free. Left alone
// when GLIBC_TUNABLES sets malloc tunables: the operator's choice wins.
void KeepBatchMemoryMapped() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && absl::StrContains(tunables, "glibc.malloc.")) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

// The /metrics exposition's TLS, scrape token and labels, from the flags.
absl::StatusOr<ampd::metrics::MetricsOptions> MetricsOptionsFromFlags() {
  ampd::metrics::MetricsOptions options;
  options.exposer.tls_cert_file = absl::GetFlag(FLAGS_metrics_tls_cert);
  options.exposer.tls_key_file = absl::GetFlag(FLAGS_metrics_tls_key);
  options.tenant_labels = absl::GetFlag(FLAGS_metrics_tenant_labels);
  if (const std::string path = absl::GetFlag(FLAGS_metrics_token_file); !path.empty()) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    if (in.is_open()) text << in.rdbuf();
    if (!in.is_open() || in.bad()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-token-file: cannot read ", path));
    }
    options.exposer.bearer_token = std::string(absl::StripAsciiWhitespace(text.str()));
    if (options.exposer.bearer_token.empty() ||
        options.exposer.bearer_token.find_first_of(" \t\r\n") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-token-file: ", path, " must hold one token, without spaces"));
    }
  }
  return options;
}

int g_signal_pipe[2] = {-1, -1};

// Async-signal-safe: one write(2), nothing else.
void OnShutdownSignal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  const int saved = errno;
  (void)!write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

// A startup failure: main prints "ampd: MESSAGE" and exits with status 1.
absl::Status StartupError(absl::string_view message) {
  return absl::FailedPreconditionError(message);
}

// Shutdown signals go through a self-pipe: the handler only write()s the
// signal number, a thread reads it and wakes main. (sigwait would need the
// signals blocked in every thread, and libraries such as OpenBLAS start
// threads before main runs.)
absl::Status InstallSignalHandlers() {
  if (pipe(g_signal_pipe) != 0) {
    return StartupError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  struct sigaction action = {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return absl::OkStatus();
}

// Blocks until SIGTERM or SIGINT; returns which.
int WaitForShutdownSignal() {
  absl::Notification stop;
  int received = 0;
  std::thread waiter([&] {
    unsigned char sig = 0;
    while (read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
    }
    received = sig;
    stop.Notify();
  });
  stop.WaitForNotification();
  waiter.join();
  return received;
}

// /metrics when --metrics-listen is set, else nullptr.
absl::StatusOr<std::unique_ptr<ampd::metrics::ServerMetrics>> StartMetrics() {
  const std::string address = absl::GetFlag(FLAGS_metrics_listen);
  if (address.empty()) return nullptr;
  absl::StatusOr<ampd::metrics::MetricsOptions> metrics_options = MetricsOptionsFromFlags();
  if (!metrics_options.ok()) return StartupError(metrics_options.status().message());
  absl::StatusOr<std::unique_ptr<ampd::metrics::ServerMetrics>> started =
      ampd::metrics::ServerMetrics::Start(address, *metrics_options);
  if (!started.ok()) {
    return StartupError(absl::StrCat("--metrics_listen: ", started.status().ToString()));
  }
  std::printf("ampd: metrics on %s:%d\n", HostOf(address).c_str(), (*started)->port());
  return started;
}

// Who may call: the tenants file, or nobody checked (then only loopback by
// default), with the flags that depend on it checked against it.
absl::StatusOr<ampd::rpc::Authenticator> AuthenticatorFromFlags() {
  ampd::rpc::Authenticator authenticator;
  if (const std::string path = absl::GetFlag(FLAGS_auth_tokens); !path.empty()) {
    absl::StatusOr<std::vector<ampd::rpc::Tenant>> tenants = ampd::rpc::LoadTenantsFile(path);
    if (!tenants.ok()) {
      return StartupError(absl::StrCat("--auth-tokens: ", tenants.status().message()));
    }
    authenticator =
        ampd::rpc::Authenticator(*std::move(tenants), absl::GetFlag(FLAGS_tenant_from_client_cert));
  }
  if (absl::GetFlag(FLAGS_tenant_from_client_cert) &&
      (authenticator.open() || absl::GetFlag(FLAGS_tls_client_ca).empty())) {
    return StartupError("--tenant-from-client-cert needs --auth-tokens and --tls-client-ca");
  }
  for (const ampd::rpc::Tenant& tenant : authenticator.tenants()) {
    if (!tenant.has_token && !authenticator.tenant_from_client_cert()) {
      return StartupError(absl::StrCat("--auth-tokens: tenant '", tenant.name,
                                       "' has no token ('-') and could never call without "
                                       "--tenant-from-client-cert"));
    }
  }
  return authenticator;
}

// The registry's options from the flags, the resolved device and the
// tenants' quotas; the metrics observer when /metrics is served.
absl::StatusOr<ampd::engine::RegistryOptions> RegistryOptionsFromFlags(
    const ampd::engine::DeviceInfo& device, const ampd::rpc::Authenticator& authenticator,
    ampd::metrics::ServerMetrics* metrics) {
  ampd::engine::RegistryOptions options;
  options.device = device.name;
  options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  options.max_memory_bytes = absl::GetFlag(FLAGS_max_memory_bytes);
  options.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  options.checkpoint_sync = absl::GetFlag(FLAGS_checkpoint_sync);
  options.grad_histogram_every = absl::GetFlag(FLAGS_grad_histogram_every);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.models_dir = absl::GetFlag(FLAGS_models_dir);
  const int threads = absl::GetFlag(FLAGS_worker_threads);
  options.worker_threads =
      threads > 0 ? threads : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  options.observer = metrics;
  // The tenants' quotas are checked by the registry, beside the server-wide
  // limits (and already when it restores jobs).
  for (const ampd::rpc::Tenant& tenant : authenticator.tenants()) {
    options.tenant_quotas[tenant.name] = {.max_jobs = tenant.max_jobs,
                                          .max_memory_bytes = tenant.max_memory_bytes};
  }
  if (metrics != nullptr) {
    const int64_t total_memory = device.memory_capacity_bytes;
    options.on_device_memory = [metrics, total_memory](int64_t in_use) {
      metrics->SetDeviceMemory(in_use, total_memory);
    };
  }
  if (options.max_jobs < 0 || options.max_memory_bytes < 0 || options.checkpoint_every < 0 ||
      options.grad_histogram_every < 0) {
    return StartupError(
        "--max_jobs, --max_memory_bytes, --checkpoint_every and --grad_histogram_every must be "
        ">= 0");
  }
  return options;
}

// The meeting point's bounds: the defaults, and each tenant's share of its
// waits from --peer-waits-per-tenant.
absl::StatusOr<ampd::engine::dist::RendezvousTable::Limits> PeerLimitsFromFlags() {
  ampd::engine::dist::RendezvousTable::Limits limits;
  const int32_t per_tenant = absl::GetFlag(FLAGS_peer_waits_per_tenant);
  if (per_tenant < 1 || static_cast<size_t>(per_tenant) > limits.max_waiters) {
    return StartupError(absl::StrCat("--peer-waits-per-tenant: must be 1..", limits.max_waiters,
                                     ", got ", per_tenant));
  }
  limits.max_tenant_waiters = static_cast<size_t>(per_tenant);
  return limits;
}

// ampd_rpc_in_flight's interceptor on a port's builder, when /metrics is served.
void CountCallsInFlight(grpc::ServerBuilder& builder, ampd::metrics::ServerMetrics* metrics) {
  if (metrics == nullptr) return;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(ampd::metrics::RpcInFlightInterceptors(metrics));
  builder.experimental().SetInterceptorCreators(std::move(creators));
}

// The meeting point of distributed jobs' ranks when --peer-address is set
// (else nullptr), and what the registry needs to reach it.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartPeerServer(
    ampd::rpc::PeerService& peer_service, ampd::engine::RegistryOptions& options,
    ampd::metrics::ServerMetrics* metrics) {
  const std::string peer = absl::GetFlag(FLAGS_peer_address);
  if (peer.empty()) return nullptr;
  const std::string peer_host = HostOf(peer);
  if (peer_host.empty() || peer_host == "0.0.0.0" || peer_host == "::" || peer_host == "[::]") {
    return StartupError(
        absl::StrCat("--peer-address: ", peer,
                     ": give the address the other replicas reach this one at (e.g. the pod "
                     "IP), not a wildcard"));
  }
  grpc::ServerBuilder peer_builder;
  peer_builder.SetOption(std::make_unique<WithoutReflection>());
  int peer_port = 0;
  peer_builder.AddListeningPort(peer, grpc::InsecureServerCredentials(), &peer_port);
  peer_builder.RegisterService(&peer_service);
  CountCallsInFlight(peer_builder, metrics);
  // Join and Get hold a thread while they wait: bound the threads and the
  // message size, so peers that flood the meeting point cannot exhaust
  // the process (the table bounds what it keeps).
  grpc::ResourceQuota peer_quota("ampd-peers");
  peer_quota.SetMaxThreads(kMaxPeerThreads);
  peer_builder.SetResourceQuota(peer_quota);
  peer_builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  std::unique_ptr<grpc::Server> peer_server = peer_builder.BuildAndStart();
  if (peer_server == nullptr || peer_port == 0) {
    return StartupError(absl::StrCat("--peer-address: cannot listen on ", peer));
  }
  options.peer_host =
      peer_host.front() == '[' ? peer_host.substr(1, peer_host.size() - 2) : peer_host;
  options.rendezvous = ampd::rpc::ConnectRendezvous;
  options.max_distributed_jobs = absl::GetFlag(FLAGS_max_distributed_jobs);
  // On stdout beside the listening line: with port 0 this is how a
  // launcher learns the port to give as the group's rendezvous.
  std::printf("ampd: peers on %s:%d\n", peer_host.c_str(), peer_port);
  return peer_server;
}

// The Trainer service's options: state-dict limits and the authenticator.
absl::StatusOr<ampd::rpc::ServiceOptions> ServiceOptionsFromFlags(
    const ampd::engine::RegistryOptions& options, const ampd::rpc::Authenticator* authenticator) {
  ampd::rpc::ServiceOptions service_options;
  if (options.max_memory_bytes > 0) service_options.max_state_dict_bytes = options.max_memory_bytes;
  service_options.max_state_dict_buffer_bytes = absl::GetFlag(FLAGS_max_state_dict_buffer_bytes);
  if (service_options.max_state_dict_buffer_bytes < 0) {
    return StartupError("--max_state_dict_buffer_bytes must be >= 0");
  }
  if (service_options.max_state_dict_buffer_bytes == 0) {
    // A quarter of physical memory: room for a few large imports at once
    // without letting concurrent streams take the machine down.
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGE_SIZE);
    service_options.max_state_dict_buffer_bytes =
        pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size / 4 : int64_t{1} << 30;
  }
  service_options.authenticator = authenticator;
  return service_options;
}

// The Trainer service on --listen, with TLS per the --tls-* flags and gRPC's
// health service; *port is the port it listens on.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartTrainerServer(
    ampd::rpc::TrainerService& service, const ampd::rpc::Authenticator& authenticator,
    ampd::metrics::ServerMetrics* metrics, std::string* listen, int* port) {
  const int32_t reload_interval = absl::GetFlag(FLAGS_tls_reload_interval_s);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ampd::rpc::MakeServerCredentials(
          {.cert = absl::GetFlag(FLAGS_tls_cert),
           .key = absl::GetFlag(FLAGS_tls_key),
           .client_ca = absl::GetFlag(FLAGS_tls_client_ca),
           .reload_interval_s = static_cast<unsigned int>(std::max(reload_interval, 0))});
  if (!credentials.ok()) return StartupError(credentials.status().ToString());
  if (authenticator.open()) {
    std::fprintf(stderr, "ampd: WARNING: no --auth-tokens: every client may call every method\n");
  } else if (absl::GetFlag(FLAGS_tls_cert).empty()) {
    std::fprintf(stderr,
                 "ampd: WARNING: --auth-tokens without --tls-cert: tokens travel in clear\n");
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!absl::GetFlag(FLAGS_reflection)) {
    builder.SetOption(std::make_unique<WithoutReflection>());
  }
  *listen = absl::GetFlag(FLAGS_listen);
  if (listen->empty()) *listen = authenticator.open() ? "127.0.0.1:50051" : "0.0.0.0:50051";
  builder.AddListeningPort(*listen, *credentials, port);
  const int64_t max_receive = absl::GetFlag(FLAGS_max_receive_message_bytes);
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(std::max<int64_t>(max_receive, 1), INT32_MAX)));
  builder.RegisterService(&service);
  CountCallsInFlight(builder, metrics);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return StartupError(absl::StrCat("--listen: cannot listen on ", *listen));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  return server;
}

// After a shutdown signal: not serving, the grace, then draining: Samples
// stop at once (their length is the client's max_tokens), other calls in
// flight finish (their steps on the job workers) or, past the shutdown
// timeout, are cancelled and stop at their next unit of work; every job
// checkpoints, the registry stops, and the peer port closes last.
absl::Status Drain(grpc::Server& server, ampd::engine::JobRegistry& registry,
                   grpc::Server* peer_server) {
  server.GetHealthCheckService()->SetServingStatus(false);
  if (const int64_t grace = absl::GetFlag(FLAGS_drain_grace_ms); grace > 0) {
    absl::SleepFor(absl::Milliseconds(grace));
  }
  registry.StartDraining();
  server.Shutdown(std::chrono::system_clock::now() +
                  std::chrono::milliseconds(absl::GetFlag(FLAGS_shutdown_timeout_ms)));
  server.Wait();
  const absl::Status checkpointed = registry.CheckpointAll();
  registry.Shutdown();
  if (peer_server != nullptr) {
    // Other replicas' waits here end now rather than at their timeouts.
    peer_server->Shutdown(std::chrono::system_clock::now());
    peer_server->Wait();
  }
  return checkpointed;
}

// Flags -> config -> registry -> servers -> serve until a signal. Every
// startup error is returned, and main prints it; so is a final checkpoint
// that could not be written (the exit status says the drain lost work).
absl::Status Run() {
  KeepBatchMemoryMapped();
  AMPD_RETURN_IF_ERROR(InstallSignalHandlers());
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<ampd::metrics::ServerMetrics> metrics, StartMetrics());
  // Resolve --device once ("auto" becomes "cuda:0" or "cpu") by creating a
  // backend: a missing GPU fails here, clearly, instead of at the first job.
  absl::StatusOr<ampd::engine::DeviceInfo> device =
      ampd::engine::ResolveDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return StartupError(absl::StrCat("--device: ", device.status().ToString()));
  AMPD_ASSIGN_OR_RETURN(const ampd::rpc::Authenticator authenticator, AuthenticatorFromFlags());
  AMPD_ASSIGN_OR_RETURN(ampd::engine::RegistryOptions options,
                        RegistryOptionsFromFlags(*device, authenticator, metrics.get()));

  // The meeting point of distributed jobs' ranks, up before any job is
  // restored so that the other replicas can meet this one's jobs. It serves
  // only the groups of this ampd's jobs, authenticated with their secrets:
  // none until the registry exists (a rank that comes sooner is told
  // NOT_FOUND and tries again).
  std::atomic<ampd::engine::JobRegistry*> hosted_jobs{nullptr};
  using ampd::engine::dist::RendezvousTable;
  AMPD_ASSIGN_OR_RETURN(const RendezvousTable::Limits peer_limits, PeerLimitsFromFlags());
  RendezvousTable rendezvous_table(peer_limits, [&hosted_jobs](const std::string& group) {
    std::vector<RendezvousTable::GroupOwner> owners;
    ampd::engine::JobRegistry* jobs = hosted_jobs.load();
    if (jobs == nullptr) return owners;
    for (ampd::engine::JobRegistry::PeerSecret& job : jobs->PeerSecrets(group)) {
      owners.push_back({std::move(job.secret), std::move(job.owner)});
    }
    return owners;
  });
  ampd::rpc::PeerService peer_service(&rendezvous_table);
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> peer_server,
                        StartPeerServer(peer_service, options, metrics.get()));

  absl::StatusOr<std::unique_ptr<ampd::engine::JobRegistry>> registry =
      ampd::engine::JobRegistry::Create(options);
  if (!registry.ok()) {
    return StartupError(absl::StrCat("--state_dir: ", registry.status().ToString()));
  }
  hosted_jobs.store(registry->get());
  // Destroyed before the registry on every return: the peer port stops
  // asking it for its jobs' secrets first.
  absl::Cleanup forget_hosted_jobs = [&hosted_jobs] { hosted_jobs.store(nullptr); };
  // The engine reads its checkpoints' configs itself; the rpc decoder is
  // only for checkpoints of earlier versions (ampd.create_request).
  if (absl::Status s = (*registry)->RestoreAll(ampd::rpc::DecodeCreateRequest); !s.ok()) {
    return StartupError(absl::StrCat("restoring jobs: ", s.ToString()));
  }

  ampd::rpc::RpcRecorder record;
  if (metrics != nullptr) {
    ampd::metrics::ServerMetrics* m = metrics.get();
    record = [m](absl::string_view method, absl::string_view code, double seconds) {
      m->RecordRpc(method, code, seconds);
    };
  }
  AMPD_ASSIGN_OR_RETURN(const ampd::rpc::ServiceOptions service_options,
                        ServiceOptionsFromFlags(options, &authenticator));
  ampd::rpc::TrainerService service(registry->get(), record, service_options);
  std::string listen;
  int port = 0;
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> server,
                        StartTrainerServer(service, authenticator, metrics.get(), &listen, &port));
  std::printf("ampd: listening on %s:%d\n", HostOf(listen).c_str(), port);
  std::fflush(stdout);
  const bool tls = !absl::GetFlag(FLAGS_tls_cert).empty();
  std::fprintf(
      stderr, "ampd: serving on %s:%d (%s, %s) with device %s, %lld job(s) restored\n",
      HostOf(listen).c_str(), port,
      tls ? (absl::GetFlag(FLAGS_tls_client_ca).empty() ? "TLS" : "mutual TLS") : "plaintext",
      authenticator.open() ? "open" : "bearer tokens", device->name.c_str(),
      static_cast<long long>((*registry)->job_count()));

  const int received = WaitForShutdownSignal();
  std::fprintf(stderr, "ampd: %s received, draining\n", received == SIGINT ? "SIGINT" : "SIGTERM");
  const absl::Status checkpointed = Drain(*server, **registry, peer_server.get());
  std::fprintf(stderr, "ampd: stopped\n");
  if (!checkpointed.ok()) {
    return absl::Status(checkpointed.code(),
                        absl::StrCat("final checkpoints: ", checkpointed.message()));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists this file's flags (absl matches files named after the binary,
  // and this one is main.cc).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/main.cc");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "ampd: mixed-precision (fp16/bf16) training service over gRPC (ampd.v1.Trainer).\n"
      "Usage: ampd --listen=HOST:PORT [--state-dir=DIR] [--device=auto|cpu|cuda[:N]] ...");
  std::vector<std::string> arg_storage;
  ampd::ParseDashedCommandLine(argc, argv, arg_storage);
  const absl::Status status = Run();
  if (!status.ok()) std::fprintf(stderr, "ampd: %s\n", std::string(status.message()).c_str());
  return status.ok() ? 0 : 1;
}
