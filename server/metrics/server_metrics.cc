// ServerMetrics: the families, the per-job series and the engine-bin to
// Prometheus-bucket mapping of the gradient magnitude histogram. Names follow
// Prometheus conventions (base units, _total on counters); the HELP strings
// are the operator's documentation, so they say how each value is derived.
#include "server/metrics/server_metrics.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::metrics {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;

constexpr int kMinLog2 = engine::kGradHistogramMinLog2;  // -30
constexpr int kMaxLog2 = engine::kGradHistogramMaxLog2;  // 20
constexpr int kEngineBins = engine::kGradHistogramBins;  // 53
// Prometheus buckets of ampd_grad_magnitude_log2: one per integer bound
// -30..20 plus +Inf. Every engine bin but the zero bin lands in exactly one.
constexpr int kLog2Buckets = (kMaxLog2 - kMinLog2 + 1) + 1;
static_assert(kLog2Buckets == kEngineBins - 1,
              "engine bins 1.. must map one to one onto the log2 buckets");

constexpr std::array<const char*, 5> kPhases = {"forward", "backward", "unscale", "optimizer",
                                                "total"};
// The phases only a distributed job's rank has (PhaseSeconds::allreduce and
// ::wait), kept apart so a single job's step_duration series are unchanged.
constexpr std::array<const char*, 2> kDistributedPhases = {"allreduce", "wait"};

// Engine bins -> bucket increments for Histogram::ObserveMultiple, which
// takes per-bucket (non-cumulative) counts and cumulates at scrape time.
// Engine bin i >= 2 holds log2|g| in [i-32, i-31), so its upper bound is the
// bucket le=i-31, index i-1; bin 1 (below 2^-30) is bucket le=-30, index 0;
// the last bin (>= 2^20, inf, NaN) is the +Inf bucket, index 51. So
// increments[j] = bins[j + 1]. The sum counts each element at the middle of
// its octave; the open-ended end bins count at -30.5 and 20.5, since the
// engine does not report how far past the range they lie.
struct Log2Observation {
  std::vector<double> increments;
  double sum = 0;
};

Log2Observation EngineBinsToBuckets(const std::vector<int64_t>& bins) {
  Log2Observation obs;
  obs.increments.resize(kLog2Buckets);
  for (int j = 0; j < kLog2Buckets; ++j) {
    const double count = static_cast<double>(std::max<int64_t>(bins[j + 1], 0));
    obs.increments[j] = count;
    // Bucket j's upper bound is kMinLog2 + j; its octave's middle is 0.5
    // below. Bucket 0 (underflow) and the +Inf bucket use the end values.
    const double mid = (j == kLog2Buckets - 1) ? kMaxLog2 + 0.5 : kMinLog2 + j - 0.5;
    obs.sum += count * mid;
  }
  return obs;
}

}  // namespace

prometheus::Histogram::BucketBoundaries GradMagnitudeLog2Bounds() {
  prometheus::Histogram::BucketBoundaries bounds;
  for (int k = kMinLog2; k <= kMaxLog2; ++k) bounds.push_back(k);
  return bounds;
}

prometheus::Histogram::BucketBoundaries DurationBounds() {
  // A tiny CPU job steps in well under a millisecond, a large GPU step or a
  // checkpointing RPC takes seconds: 1-2.5-5 per decade covers both.
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   25,    50};
}

// One job's series. mu serialises the job's updates with its removal, so an
// OnStep that looked the job up just before OnJobDeleted never touches a
// metric the family has already destroyed. Only the job's own worker takes
// it on the step path, so it is uncontended there.
struct ServerMetrics::JobSeries {
  std::string job_id;
  prometheus::Labels labels;  // job, and tenant where there is one
  absl::Mutex mu;
  bool removed ABSL_GUARDED_BY(mu) = false;
  Gauge* loss_scale = nullptr;
  Counter* steps = nullptr;
  Counter* skipped_nonfinite = nullptr;
  Counter* growths = nullptr;
  Counter* backoffs = nullptr;
  Counter* growths_deferred = nullptr;
  Gauge* grad_underflow_fraction ABSL_GUARDED_BY(mu) = nullptr;  // from the first sampled step
  Gauge* loss = nullptr;
  Gauge* grad_norm ABSL_GUARDED_BY(mu) = nullptr;  // created on the first reported norm
  // Created on the first step whose loss read sampling_logprobs.
  Gauge* logprob_mismatch ABSL_GUARDED_BY(mu) = nullptr;
  Histogram* grad_magnitude = nullptr;
  Counter* grad_zero_elements = nullptr;
  std::array<Histogram*, kPhases.size()> phase_seconds{};
  Counter* samples = nullptr;
  Gauge* learning_rate ABSL_GUARDED_BY(mu) = nullptr;  // created on the first step
  Counter* evaluations = nullptr;
  Histogram* evaluate_seconds = nullptr;
  Gauge* eval_loss ABSL_GUARDED_BY(mu) = nullptr;  // created on the first evaluation
  // ForwardBackward calls accumulated and not applied; created on the first.
  Gauge* accumulated_pending ABSL_GUARDED_BY(mu) = nullptr;
  // Sampler snapshots held and their bytes; created on the first save.
  Gauge* sampler_snapshots ABSL_GUARDED_BY(mu) = nullptr;
  Gauge* sampler_snapshot_bytes ABSL_GUARDED_BY(mu) = nullptr;
  Counter* sampled_tokens = nullptr;
  Counter* sampled_sequences = nullptr;
  Histogram* sample_seconds = nullptr;
  // A distributed job's: null for a single job.
  bool distributed ABSL_GUARDED_BY(mu) = false;
  std::array<Histogram*, kDistributedPhases.size()> distributed_phase_seconds ABSL_GUARDED_BY(mu){};
  Counter* formations_copied ABSL_GUARDED_BY(mu) = nullptr;  // copied_state="true"
  Counter* formations_kept ABSL_GUARDED_BY(mu) = nullptr;    // copied_state="false"
  Gauge* rank ABSL_GUARDED_BY(mu) = nullptr;                 // only when the config was seen
  Gauge* world_size ABSL_GUARDED_BY(mu) = nullptr;           // likewise
  // Per-layer loss scales, one per layer group, created on the first step
  // that reports them.
  std::vector<Gauge*> loss_scale_layer ABSL_GUARDED_BY(mu);
};

ServerMetrics::ServerMetrics(const MetricsOptions& options)
    : tenant_labels_(options.tenant_labels),
      registry_(std::make_shared<prometheus::Registry>()),
      loss_scale_(BuildGauge()
                      .Name("ampd_loss_scale")
                      .Help("Loss scale S after the job's last step (1 when scaling is disabled).")
                      .Register(*registry_)),
      steps_(BuildCounter()
                 .Name("ampd_steps_total")
                 .Help("Step and OptimStep calls run by the job, applied and skipped.")
                 .Register(*registry_)),
      skipped_steps_(BuildCounter()
                         .Name("ampd_skipped_steps_total")
                         .Help("Steps whose optimizer update was skipped, by reason (nonfinite: "
                               "inf or NaN in the scaled gradients).")
                         .Register(*registry_)),
      growths_(BuildCounter()
                   .Name("ampd_loss_scale_growths_total")
                   .Help("Steps after which the scaler grew the loss scale.")
                   .Register(*registry_)),
      backoffs_(BuildCounter()
                    .Name("ampd_loss_scale_backoffs_total")
                    .Help("Steps after which the scaler backed the loss scale off.")
                    .Register(*registry_)),
      growths_deferred_(
          BuildCounter()
              .Name("ampd_loss_scale_growths_deferred_total")
              .Help("Scheduled loss-scale growths the adaptive scaler deferred because the "
                    "step's max|g| times the grown scale would have left its overflow margin "
                    "(each one a skipped step a framework scaler would have paid); 0 for the "
                    "other policies.")
              .Register(*registry_)),
      grad_underflow_fraction_(
          BuildGauge()
              .Name("ampd_grad_underflow_fraction")
              .Help("Fraction of the scaled gradient elements at zero or fp16-subnormal "
                    "(below 2^-14) on the job's last sampled step; absent until one.")
              .Register(*registry_)),
      loss_(BuildGauge()
                .Name("ampd_loss")
                .Help("Unscaled fp32 loss of the job's last step, mean over its micro-batches.")
                .Register(*registry_)),
      grad_norm_(BuildGauge()
                     .Name("ampd_grad_norm")
                     .Help("L2 norm of the unscaled gradients of the job's last step that "
                           "computed one (gradient clipping); absent until then.")
                     .Register(*registry_)),
      logprob_mismatch_(
          BuildGauge()
              .Name("ampd_logprob_mismatch")
              .Help("max |trainer log-prob - sampling_logprob| over the target tokens of the "
                    "job's last step with sampling_logprobs (importance_sampling, ppo, cispo, "
                    "dro), the trainer's from that "
                    "step's forward: the sampler-trainer mismatch on samples from the same "
                    "weights (0 on a batch_invariant job); absent until such a step.")
              .Register(*registry_)),
      grad_magnitude_(
          BuildHistogram()
              .Name("ampd_grad_magnitude_log2")
              .Help("log2|g| of the scaled gradient elements on sampled steps. Bucket le=k "
                    "counts |g| < 2^k (engine octaves are half-open): le=-30 holds everything "
                    "below 2^-30, fp16 subnormals are below le=-14, fp16 underflows to zero "
                    "below le=-24, fp16 overflows (max 65504) past le=16, and +Inf holds |g| "
                    ">= 2^20 together with every inf and NaN element (the engine bins them "
                    "together). Exact zeros are not observed here: see "
                    "ampd_grad_zero_elements_total. _sum counts each element at its octave's "
                    "middle (-30.5 and 20.5 for the open-ended ends).")
              .Register(*registry_)),
      grad_zero_elements_(BuildCounter()
                              .Name("ampd_grad_zero_elements_total")
                              .Help("Scaled gradient elements exactly zero on sampled steps "
                                    "(underflow shows up here), kept out of "
                                    "ampd_grad_magnitude_log2 because log2(0) is -inf.")
                              .Register(*registry_)),
      step_duration_(BuildHistogram()
                         .Name("ampd_step_duration_seconds")
                         .Help("Wall time of a step by phase: forward, backward, unscale "
                               "(non-finite check and norm), optimizer, total; a distributed "
                               "job's rank also allreduce (summing gradients, loss and found_inf "
                               "across the ranks) and wait (the step's first all-gather: how "
                               "long this rank waited for the slowest rank to send its share).")
                         .Register(*registry_)),
      samples_(BuildCounter()
                   .Name("ampd_samples_total")
                   .Help("Rows trained on, over all micro-batches of all steps.")
                   .Register(*registry_)),
      learning_rate_(BuildGauge()
                         .Name("ampd_learning_rate")
                         .Help("Learning rate of the job's last step (its schedule's, or the "
                               "step's override); absent until a step.")
                         .Register(*registry_)),
      evaluations_(BuildCounter()
                       .Name("ampd_evaluations_total")
                       .Help("Evaluate calls run by the job (forward and loss only).")
                       .Register(*registry_)),
      evaluate_duration_(BuildHistogram()
                             .Name("ampd_evaluate_duration_seconds")
                             .Help("Wall time of an evaluation on the job's worker.")
                             .Register(*registry_)),
      sampled_tokens_(BuildCounter()
                          .Name("ampd_sampled_tokens_total")
                          .Help("Tokens the job's Sample calls drew, over all completions.")
                          .Register(*registry_)),
      sampled_sequences_(BuildCounter()
                             .Name("ampd_sampled_sequences_total")
                             .Help("Completions the job's Sample calls returned.")
                             .Register(*registry_)),
      sample_duration_(BuildHistogram()
                           .Name("ampd_sample_duration_seconds")
                           .Help("Wall time of a Sample call on the job's worker.")
                           .Register(*registry_)),
      eval_loss_(BuildGauge()
                     .Name("ampd_eval_loss")
                     .Help("Unscaled fp32 loss of the job's last evaluation, mean over its "
                           "micro-batches; absent until one.")
                     .Register(*registry_)),
      accumulated_pending_(
          BuildGauge()
              .Name("ampd_accumulated_calls_pending")
              .Help("ForwardBackward calls the job holds accumulated and not yet applied by an "
                    "OptimStep (lost on a restart); absent until the job's first call.")
              .Register(*registry_)),
      sampler_snapshots_(BuildGauge()
                             .Name("ampd_sampler_snapshots")
                             .Help("Sampler snapshots the job holds (SaveSamplerSnapshot); absent "
                                   "until its first.")
                             .Register(*registry_)),
      sampler_snapshot_bytes_(
          BuildGauge()
              .Name("ampd_sampler_snapshot_bytes")
              .Help("Device bytes of the sampler snapshots the job holds (its trainable "
                    "weights' working copies, a LoRA job's adapters alone); absent until its "
                    "first.")
              .Register(*registry_)),
      group_formations_(
          BuildCounter()
              .Name("ampd_distributed_group_formations_total")
              .Help("Times a distributed job's rank formed its group with the other ranks (at "
                    "its first step, and again after a rank was lost), by whether this rank "
                    "copied the most advanced rank's state (copied_state=\"true\": it was "
                    "behind, e.g. restarted from an older checkpoint).")
              .Register(*registry_)),
      distributed_rank_(BuildGauge()
                            .Name("ampd_distributed_rank")
                            .Help("This replica's rank in its distributed job's group.")
                            .Register(*registry_)),
      distributed_world_size_(BuildGauge()
                                  .Name("ampd_distributed_world_size")
                                  .Help("Ranks in the distributed job's group.")
                                  .Register(*registry_)),
      loss_scale_layer_(
          BuildGauge()
              .Name("ampd_loss_scale_layer")
              .Help("Per-layer loss scales (adaptive with per_layer_scales): layer group "
                    "layer's scale S_g after the job's last step; the group the loss gradient "
                    "starts in is the last, whose scale is ampd_loss_scale. At most 32 groups, "
                    "so the layer label takes at most 32 values per job.")
              .Register(*registry_)),
      jobs_family_(BuildGauge()
                       .Name("ampd_jobs")
                       .Help("Training jobs the server holds.")
                       .Register(*registry_)),
      jobs_(jobs_family_.Add({})),
      device_memory_used_(BuildGauge()
                              .Name("ampd_device_memory_used_bytes")
                              .Help("Device memory in use, in bytes.")
                              .Register(*registry_)
                              .Add({})),
      device_memory_total_(BuildGauge()
                               .Name("ampd_device_memory_total_bytes")
                               .Help("Device memory in total, in bytes.")
                               .Register(*registry_)
                               .Add({})),
      shared_bases_(BuildGauge()
                        .Name("ampd_shared_bases")
                        .Help("Base models of --models-dir held once and shared by LoRA jobs.")
                        .Register(*registry_)
                        .Add({})),
      shared_base_bytes_(BuildGauge()
                             .Name("ampd_shared_base_bytes")
                             .Help("Device bytes of the shared base models (each counted once).")
                             .Register(*registry_)
                             .Add({})),
      rpc_requests_(BuildCounter()
                        .Name("ampd_rpc_requests_total")
                        .Help("Finished RPCs by method and gRPC status code.")
                        .Register(*registry_)),
      rpc_duration_(BuildHistogram()
                        .Name("ampd_rpc_duration_seconds")
                        .Help("Server-side RPC latency by method.")
                        .Register(*registry_)),
      rpc_in_flight_(BuildGauge()
                         .Name("ampd_rpc_in_flight")
                         .Help("RPCs received and not yet answered, by method.")
                         .Register(*registry_)) {}

ServerMetrics::~ServerMetrics() = default;

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Start(
    const std::string& listen_address, const MetricsOptions& options) {
  if (listen_address.empty()) {
    return absl::InvalidArgumentError("metrics listen address is empty");
  }
  std::unique_ptr<ServerMetrics> metrics(new ServerMetrics(options));
  if (!options.tenant_labels) {
    unsigned char key[32];
    if (RAND_bytes(key, sizeof(key)) != 1) {
      return absl::InternalError("metrics: no random bytes for the job labels' pseudonyms");
    }
    metrics->pseudonym_key_.assign(reinterpret_cast<const char*>(key), sizeof(key));
  }
  AMPD_ASSIGN_OR_RETURN(metrics->exposer_,
                        HttpExposer::Start(listen_address, metrics->registry_, options.exposer));
  metrics->port_ = metrics->exposer_->port();
  return metrics;
}

std::string ServerMetrics::JobLabel(const std::string& job_id) const {
  if (tenant_labels_) return job_id;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), pseudonym_key_.data(), static_cast<int>(pseudonym_key_.size()),
       reinterpret_cast<const unsigned char*>(job_id.data()), job_id.size(), digest, &length);
  return absl::StrCat(
      "j", absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), 8)));
}

std::shared_ptr<ServerMetrics::JobSeries> ServerMetrics::FindOrCreateJob(const std::string& job_id,
                                                                         const std::string& tenant,
                                                                         float initial_scale) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_by_id_.find(job_id);
  if (it != jobs_by_id_.end()) return it->second;

  auto series = std::make_shared<JobSeries>();
  series->job_id = job_id;
  // The job's labels: its id, and its tenant where the server has tenants
  // (an empty label is no label to Prometheus, so an open server's series
  // keep exactly the job label); without tenant labels, the id's pseudonym.
  prometheus::Labels job{{"job", JobLabel(job_id)}};
  if (!tenant.empty() && tenant_labels_) job.emplace("tenant", tenant);
  series->labels = job;
  const auto with = [&job](const char* name, const char* value) {
    prometheus::Labels labels = job;
    labels.emplace(name, value);
    return labels;
  };
  series->loss_scale = &loss_scale_.Add(job);
  series->loss_scale->Set(initial_scale);
  // Counters and histograms exist from creation at zero so that rate() and
  // increase() see the job's first step as an increase.
  series->steps = &steps_.Add(job);
  series->skipped_nonfinite = &skipped_steps_.Add(with("reason", "nonfinite"));
  series->growths = &growths_.Add(job);
  series->backoffs = &backoffs_.Add(job);
  series->growths_deferred = &growths_deferred_.Add(job);
  series->loss = &loss_.Add(job);
  series->grad_magnitude = &grad_magnitude_.Add(job, GradMagnitudeLog2Bounds());
  series->grad_zero_elements = &grad_zero_elements_.Add(job);
  for (size_t i = 0; i < kPhases.size(); ++i) {
    series->phase_seconds[i] = &step_duration_.Add(with("phase", kPhases[i]), DurationBounds());
  }
  series->samples = &samples_.Add(job);
  series->evaluations = &evaluations_.Add(job);
  series->evaluate_seconds = &evaluate_duration_.Add(job, DurationBounds());
  series->sampled_tokens = &sampled_tokens_.Add(job);
  series->sampled_sequences = &sampled_sequences_.Add(job);
  series->sample_seconds = &sample_duration_.Add(job, DurationBounds());
  jobs_by_id_.emplace(job_id, series);
  jobs_.Set(static_cast<double>(jobs_by_id_.size()));
  return series;
}

void ServerMetrics::AddDistributedSeries(JobSeries& series,
                                         const engine::dist::DistributedSpec* spec) {
  absl::MutexLock lock(&series.mu);
  if (series.removed) return;
  if (!series.distributed) {
    series.distributed = true;
    for (size_t i = 0; i < kDistributedPhases.size(); ++i) {
      prometheus::Labels labels = series.labels;
      labels.emplace("phase", kDistributedPhases[i]);
      series.distributed_phase_seconds[i] = &step_duration_.Add(labels, DurationBounds());
    }
    // Both at zero from the start, so the first formation is an increase.
    prometheus::Labels copied = series.labels;
    copied.emplace("copied_state", "true");
    series.formations_copied = &group_formations_.Add(copied);
    prometheus::Labels kept = series.labels;
    kept.emplace("copied_state", "false");
    series.formations_kept = &group_formations_.Add(kept);
  }
  if (spec != nullptr && series.rank == nullptr) {
    series.rank = &distributed_rank_.Add(series.labels);
    series.rank->Set(spec->rank);
    series.world_size = &distributed_world_size_.Add(series.labels);
    series.world_size->Set(spec->world_size);
  }
}

void ServerMetrics::OnJobCreated(const std::string& job_id, const std::string& tenant,
                                 const engine::JobConfig& config) {
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, tenant, config.scaler.InitialScale());
  if (config.distributed.enabled()) AddDistributedSeries(*series, &config.distributed);
}

void ServerMetrics::OnStep(const std::string& job_id, const engine::StepReport& report) {
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", report.scaler.scale_before);
  // Only a distributed job's rank reports these phases; one not announced
  // through OnJobCreated is recognised by them.
  if (report.seconds.allreduce > 0 || report.seconds.wait > 0) {
    AddDistributedSeries(*series, nullptr);
  }
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;  // deleted while this step was being reported

  series->loss_scale->Set(report.scaler.scale_after);
  series->steps->Increment();
  if (report.scaler.skipped) series->skipped_nonfinite->Increment();
  if (report.scaler.grew) series->growths->Increment();
  if (report.scaler.backed_off) series->backoffs->Increment();
  if (report.scaler.growth_deferred) series->growths_deferred->Increment();
  if (report.grad_underflow_fraction.has_value()) {
    if (series->grad_underflow_fraction == nullptr) {
      series->grad_underflow_fraction = &grad_underflow_fraction_.Add(series->labels);
    }
    series->grad_underflow_fraction->Set(*report.grad_underflow_fraction);
  }
  series->loss->Set(report.loss);
  if (report.grad_norm.has_value()) {
    if (series->grad_norm == nullptr) series->grad_norm = &grad_norm_.Add(series->labels);
    series->grad_norm->Set(*report.grad_norm);
  }
  if (report.logprob_mismatch.has_value()) {
    if (series->logprob_mismatch == nullptr) {
      series->logprob_mismatch = &logprob_mismatch_.Add(series->labels);
    }
    series->logprob_mismatch->Set(*report.logprob_mismatch);
  }
  // Anything but the engine's documented bin count is a malformed report;
  // ObserveMultiple would throw on a length mismatch inside a job worker.
  if (report.grad_histogram.size() == static_cast<size_t>(kEngineBins)) {
    const Log2Observation obs = EngineBinsToBuckets(report.grad_histogram);
    series->grad_magnitude->ObserveMultiple(obs.increments, obs.sum);
    const int64_t zeros = report.grad_histogram[0];
    if (zeros > 0) series->grad_zero_elements->Increment(static_cast<double>(zeros));
  }
  const std::array<double, kPhases.size()> seconds = {
      report.seconds.forward, report.seconds.backward, report.seconds.unscale,
      report.seconds.optimizer, report.seconds.total};
  for (size_t i = 0; i < kPhases.size(); ++i) {
    // A clock that stepped backwards must not subtract from the sum.
    series->phase_seconds[i]->Observe(std::max(seconds[i], 0.0));
  }
  if (series->distributed) {
    const std::array<double, kDistributedPhases.size()> distributed_seconds = {
        report.seconds.allreduce, report.seconds.wait};
    for (size_t i = 0; i < kDistributedPhases.size(); ++i) {
      series->distributed_phase_seconds[i]->Observe(std::max(distributed_seconds[i], 0.0));
    }
  }
  if (report.samples > 0) series->samples->Increment(static_cast<double>(report.samples));
  if (series->learning_rate == nullptr) series->learning_rate = &learning_rate_.Add(series->labels);
  series->learning_rate->Set(report.learning_rate);
  // Bounded cardinality: the engine refuses more groups than this, and a
  // report with more exports the first kMaxLayerScaleGroups.
  const size_t layers = std::min(report.scaler.layer_scales_after.size(),
                                 static_cast<size_t>(engine::amp::kMaxLayerScaleGroups));
  for (size_t g = series->loss_scale_layer.size(); g < layers; ++g) {
    prometheus::Labels labels = series->labels;
    labels.emplace("layer", std::to_string(g));
    series->loss_scale_layer.push_back(&loss_scale_layer_.Add(labels));
  }
  for (size_t g = 0; g < layers; ++g) {
    series->loss_scale_layer[g]->Set(report.scaler.layer_scales_after[g]);
  }
}

void ServerMetrics::OnEvaluate(const std::string& job_id, const engine::EvaluateReport& report) {
  // No step has reported a scale yet when this creates the series; 1 is
  // corrected by the job's first step.
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", 1.0f);
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;
  series->evaluations->Increment();
  series->evaluate_seconds->Observe(std::isfinite(report.seconds) ? std::max(report.seconds, 0.0)
                                                                  : 0.0);
  if (series->eval_loss == nullptr) series->eval_loss = &eval_loss_.Add(series->labels);
  series->eval_loss->Set(report.loss);
}

void ServerMetrics::OnSample(const std::string& job_id, const engine::SampleReport& report) {
  // As in OnEvaluate, 1 stands for the scale until the job's first step.
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", 1.0f);
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;
  int64_t sequences = 0;
  for (const auto& per_prompt : report.completions) {
    sequences += static_cast<int64_t>(per_prompt.size());
  }
  series->sampled_tokens->Increment(static_cast<double>(report.tokens));
  series->sampled_sequences->Increment(static_cast<double>(sequences));
  series->sample_seconds->Observe(std::isfinite(report.seconds) ? std::max(report.seconds, 0.0)
                                                                : 0.0);
}

void ServerMetrics::OnAccumulated(const std::string& job_id, int64_t pending) {
  // As in OnEvaluate, 1 stands for the scale until the job's first step.
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", 1.0f);
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;
  if (series->accumulated_pending == nullptr) {
    series->accumulated_pending = &accumulated_pending_.Add(series->labels);
  }
  series->accumulated_pending->Set(static_cast<double>(pending));
}

void ServerMetrics::OnSamplerSnapshots(const std::string& job_id, int64_t count, int64_t bytes) {
  // As in OnEvaluate, 1 stands for the scale until the job's first step.
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", 1.0f);
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;
  if (series->sampler_snapshots == nullptr) {
    series->sampler_snapshots = &sampler_snapshots_.Add(series->labels);
    series->sampler_snapshot_bytes = &sampler_snapshot_bytes_.Add(series->labels);
  }
  series->sampler_snapshots->Set(static_cast<double>(count));
  series->sampler_snapshot_bytes->Set(static_cast<double>(bytes));
}

void ServerMetrics::OnGroupFormed(const std::string& job_id,
                                  const engine::GroupFormation& formation) {
  // As in OnEvaluate, 1 stands for the scale until the job's first step.
  std::shared_ptr<JobSeries> series = FindOrCreateJob(job_id, "", 1.0f);
  AddDistributedSeries(*series, nullptr);
  absl::MutexLock lock(&series->mu);
  if (series->removed) return;
  (formation.copied_state ? series->formations_copied : series->formations_kept)->Increment();
}

void ServerMetrics::RemoveSeries(JobSeries& series) {
  absl::MutexLock lock(&series.mu);
  series.removed = true;
  loss_scale_.Remove(series.loss_scale);
  steps_.Remove(series.steps);
  skipped_steps_.Remove(series.skipped_nonfinite);
  growths_.Remove(series.growths);
  backoffs_.Remove(series.backoffs);
  growths_deferred_.Remove(series.growths_deferred);
  if (series.grad_underflow_fraction != nullptr) {
    grad_underflow_fraction_.Remove(series.grad_underflow_fraction);
  }
  loss_.Remove(series.loss);
  if (series.grad_norm != nullptr) grad_norm_.Remove(series.grad_norm);
  if (series.logprob_mismatch != nullptr) logprob_mismatch_.Remove(series.logprob_mismatch);
  grad_magnitude_.Remove(series.grad_magnitude);
  grad_zero_elements_.Remove(series.grad_zero_elements);
  for (Histogram* h : series.phase_seconds) step_duration_.Remove(h);
  samples_.Remove(series.samples);
  if (series.learning_rate != nullptr) learning_rate_.Remove(series.learning_rate);
  evaluations_.Remove(series.evaluations);
  evaluate_duration_.Remove(series.evaluate_seconds);
  sampled_tokens_.Remove(series.sampled_tokens);
  sampled_sequences_.Remove(series.sampled_sequences);
  sample_duration_.Remove(series.sample_seconds);
  if (series.eval_loss != nullptr) eval_loss_.Remove(series.eval_loss);
  if (series.accumulated_pending != nullptr) {
    accumulated_pending_.Remove(series.accumulated_pending);
  }
  if (series.sampler_snapshots != nullptr) {
    sampler_snapshots_.Remove(series.sampler_snapshots);
    sampler_snapshot_bytes_.Remove(series.sampler_snapshot_bytes);
  }
  if (series.distributed) {
    for (Histogram* h : series.distributed_phase_seconds) step_duration_.Remove(h);
    group_formations_.Remove(series.formations_copied);
    group_formations_.Remove(series.formations_kept);
  }
  if (series.rank != nullptr) distributed_rank_.Remove(series.rank);
  if (series.world_size != nullptr) distributed_world_size_.Remove(series.world_size);
  for (Gauge* g : series.loss_scale_layer) loss_scale_layer_.Remove(g);
}

void ServerMetrics::OnJobDeleted(const std::string& job_id) {
  std::shared_ptr<JobSeries> series;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_by_id_.find(job_id);
    if (it == jobs_by_id_.end()) return;
    series = std::move(it->second);
    jobs_by_id_.erase(it);
    jobs_.Set(static_cast<double>(jobs_by_id_.size()));
  }
  RemoveSeries(*series);
}

void ServerMetrics::RecordRpc(absl::string_view method, absl::string_view code, double seconds) {
  Counter* requests;
  Histogram* duration;
  {
    // Family::Add would build a throwaway Histogram on every call just to
    // find the existing one, so the handles are cached per (method, code).
    absl::MutexLock lock(&rpc_mu_);
    RpcSeries& rpc = rpc_series_[absl::StrCat(method, "\n", code)];
    if (rpc.requests == nullptr) {
      rpc.requests =
          &rpc_requests_.Add({{"method", std::string(method)}, {"code", std::string(code)}});
      rpc.duration = &rpc_duration_.Add({{"method", std::string(method)}}, DurationBounds());
    }
    requests = rpc.requests;
    duration = rpc.duration;
  }
  requests->Increment();
  duration->Observe(std::isfinite(seconds) ? std::max(seconds, 0.0) : 0.0);
}

prometheus::Gauge& ServerMetrics::RpcInFlight(absl::string_view method) {
  absl::MutexLock lock(&rpc_mu_);
  auto it = rpc_in_flight_series_.find(method);
  if (it != rpc_in_flight_series_.end()) return *it->second;
  // A method name comes from the client's request line: bound the labels.
  const std::string label =
      rpc_in_flight_series_.size() < kMaxInFlightMethods ? std::string(method) : "other";
  prometheus::Gauge& gauge = rpc_in_flight_.Add({{"method", label}});
  rpc_in_flight_series_.emplace(label, &gauge);
  return gauge;
}

void ServerMetrics::OnSharedBases(int64_t count, int64_t bytes) {
  shared_bases_.Set(static_cast<double>(count));
  shared_base_bytes_.Set(static_cast<double>(bytes));
}

void ServerMetrics::SetDeviceMemory(int64_t in_use_bytes, int64_t total_bytes) {
  device_memory_used_.Set(static_cast<double>(in_use_bytes));
  device_memory_total_.Set(static_cast<double>(total_bytes));
}

}  // namespace ampd::metrics
