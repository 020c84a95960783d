// ServerMetrics: ampd's Prometheus exposition. It is the engine's JobObserver
// (per-job loss scale, skips, growths/backoffs, loss, grad norm, gradient
// magnitude histogram, phase timings, samples, learning rate, evaluations; a distributed job's
// all-reduce and straggler-wait phases, rank, world size and group formations) and the rpc layer's
// request recorder, and it serves GET /metrics (http_exposer.h says why not with prometheus-cpp's
// civetweb exposer). The engine never includes this header; main.cc hands the engine a JobObserver
// pointer to it.
//
// Thread-safe: OnStep runs concurrently on different jobs' workers. A job's
// metric handles are created once (OnJobCreated) and looked up under a short
// map lock; the updates themselves are prometheus-cpp atomics.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/engine/jobs/job_observer.h"
#include "server/metrics/http_exposer.h"

namespace ampd::metrics {

// Bucket upper bounds of ampd_grad_magnitude_log2: the integers
// kGradHistogramMinLog2..kGradHistogramMaxLog2 (-30..20), one per engine
// octave bin. Exposed for tests and for anyone decoding the buckets.
prometheus::Histogram::BucketBoundaries GradMagnitudeLog2Bounds();
// Bucket upper bounds of ampd_step_duration_seconds and
// ampd_rpc_duration_seconds, in seconds (100 us .. 50 s, 1-2.5-5 steps).
prometheus::Histogram::BucketBoundaries DurationBounds();

struct MetricsOptions {
  ExposerOptions exposer;  // TLS and a bearer token for the scrape
  // false: no series names its tenant (no tenant label) or carries its job
  // id: the job label is a pseudonym instead ("j" and 16 hex digits, an
  // HMAC of the id under a key drawn at start), stable for the process's
  // life, so that a scraper on a shared node learns no tenant's names or
  // ids. Per-job series, dashboards and alerts work as before.
  bool tenant_labels = true;
};

class ServerMetrics final : public engine::JobObserver {
 public:
  // Serves GET /metrics on listen_address ("127.0.0.1:9464"; port 0 picks a
  // free port). InvalidArgument for an empty address or unusable TLS files,
  // Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Start(const std::string& listen_address,
                                                              const MetricsOptions& options = {});
  ~ServerMetrics() override;

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  int port() const { return port_; }  // the bound port

  // Creates the job's series; the loss scale starts at the config's initial
  // scale (1 when scaling is disabled) so a job that has not stepped yet
  // already charts where it will start. A distributed job (one rank of a
  // group) also gets the phases "allreduce" and "wait", its rank and world
  // size, and its formation counters; a single job's series stay as they were.
  void OnJobCreated(const std::string& job_id, const std::string& tenant,
                    const engine::JobConfig& config) override;
  // A job never announced through OnJobCreated (a wiring gap, e.g. a job
  // restored from the state directory) gets its series on its first step
  // rather than going unobserved. The engine must not report a job's step
  // after its OnJobDeleted (its ordered worker is drained first), or the
  // series would come back.
  void OnStep(const std::string& job_id, const engine::StepReport& report) override;
  // Counts the evaluation and observes its wall time; like OnStep, creates
  // the series of a job not announced.
  void OnEvaluate(const std::string& job_id, const engine::EvaluateReport& report) override;
  // Counts the sampled tokens and completions and observes the call's wall
  // time; like OnStep, creates the series of a job not announced.
  void OnSample(const std::string& job_id, const engine::SampleReport& report) override;
  void OnJobDeleted(const std::string& job_id) override;  // removes that job's series
  // Sets ampd_accumulated_calls_pending; like OnStep, creates the series of
  // a job not announced.
  void OnAccumulated(const std::string& job_id, int64_t pending) override;
  // Sets ampd_sampler_snapshots and ampd_sampler_snapshot_bytes; like
  // OnStep, creates the series of a job not announced.
  void OnSamplerSnapshots(const std::string& job_id, int64_t count, int64_t bytes) override;
  // Sets ampd_shared_bases and ampd_shared_base_bytes (server-wide).
  void OnSharedBases(int64_t count, int64_t bytes) override;
  // Counts the formation by copied_state. A job not announced gets its
  // series here (as in OnEvaluate), with the distributed phases but without
  // rank and world size, which only its config carries.
  void OnGroupFormed(const std::string& job_id, const engine::GroupFormation& formation) override;

  // One finished RPC, e.g. ("Step", "OK", 0.004); code is the gRPC status
  // code's canonical name.
  void RecordRpc(absl::string_view method, absl::string_view code, double seconds);
  // The gauge ampd_rpc_in_flight{method}: the method's calls received and
  // not yet answered, moved by rpc_in_flight.h's interceptor. The handle
  // lives as long as this object; past kMaxInFlightMethods distinct methods,
  // every further one shares method="other".
  prometheus::Gauge& RpcInFlight(absl::string_view method);
  static constexpr size_t kMaxInFlightMethods = 64;
  void SetDeviceMemory(int64_t in_use_bytes, int64_t total_bytes);

 private:
  struct JobSeries;
  struct RpcSeries {
    prometheus::Counter* requests = nullptr;
    prometheus::Histogram* duration = nullptr;
  };

  explicit ServerMetrics(const MetricsOptions& options);
  // The job label's value: the id, or its pseudonym without tenant labels.
  std::string JobLabel(const std::string& job_id) const;
  // The job's series, created on first use. Takes mu_.
  std::shared_ptr<JobSeries> FindOrCreateJob(const std::string& job_id, const std::string& tenant,
                                             float initial_scale);
  // Adds the series only a distributed job has (once); `spec` null when the
  // job's config is unknown. Takes series.mu.
  void AddDistributedSeries(JobSeries& series, const engine::dist::DistributedSpec* spec);
  void RemoveSeries(JobSeries& series);

  const bool tenant_labels_;
  std::string pseudonym_key_;  // random; only without tenant labels
  std::shared_ptr<prometheus::Registry> registry_;

  // Per job (label job).
  prometheus::Family<prometheus::Gauge>& loss_scale_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Counter>& skipped_steps_;
  prometheus::Family<prometheus::Counter>& growths_;
  prometheus::Family<prometheus::Counter>& backoffs_;
  prometheus::Family<prometheus::Counter>& growths_deferred_;
  prometheus::Family<prometheus::Gauge>& grad_underflow_fraction_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Gauge>& grad_norm_;
  prometheus::Family<prometheus::Gauge>& logprob_mismatch_;
  prometheus::Family<prometheus::Histogram>& grad_magnitude_;
  prometheus::Family<prometheus::Counter>& grad_zero_elements_;
  prometheus::Family<prometheus::Histogram>& step_duration_;
  prometheus::Family<prometheus::Counter>& samples_;
  prometheus::Family<prometheus::Gauge>& learning_rate_;
  prometheus::Family<prometheus::Counter>& evaluations_;
  prometheus::Family<prometheus::Histogram>& evaluate_duration_;
  prometheus::Family<prometheus::Counter>& sampled_tokens_;
  prometheus::Family<prometheus::Counter>& sampled_sequences_;
  prometheus::Family<prometheus::Histogram>& sample_duration_;
  prometheus::Family<prometheus::Gauge>& eval_loss_;
  prometheus::Family<prometheus::Gauge>& accumulated_pending_;
  prometheus::Family<prometheus::Gauge>& sampler_snapshots_;
  prometheus::Family<prometheus::Gauge>& sampler_snapshot_bytes_;
  prometheus::Family<prometheus::Counter>& group_formations_;
  prometheus::Family<prometheus::Gauge>& distributed_rank_;
  prometheus::Family<prometheus::Gauge>& distributed_world_size_;
  // Per job and layer group (label layer="0".."31"): per-layer loss scales.
  prometheus::Family<prometheus::Gauge>& loss_scale_layer_;

  // Server-wide.
  prometheus::Family<prometheus::Gauge>& jobs_family_;
  prometheus::Gauge& jobs_;
  prometheus::Gauge& device_memory_used_;
  prometheus::Gauge& device_memory_total_;
  prometheus::Gauge& shared_bases_;
  prometheus::Gauge& shared_base_bytes_;
  prometheus::Family<prometheus::Counter>& rpc_requests_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Gauge>& rpc_in_flight_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<JobSeries>> jobs_by_id_ ABSL_GUARDED_BY(mu_);
  absl::Mutex rpc_mu_;
  // Keyed by method + '\n' + code; RPC series live as long as the server.
  absl::flat_hash_map<std::string, RpcSeries> rpc_series_ ABSL_GUARDED_BY(rpc_mu_);
  absl::flat_hash_map<std::string, prometheus::Gauge*> rpc_in_flight_series_
      ABSL_GUARDED_BY(rpc_mu_);

  // Declared last so it is destroyed first: no scrape may read the registry
  // while the families above are being torn down.
  std::unique_ptr<HttpExposer> exposer_;
  int port_ = 0;
};

}  // namespace ampd::metrics
