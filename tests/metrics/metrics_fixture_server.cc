// A stand-in for a live ampd's metrics endpoint: starts ServerMetrics, feeds
// job "fixture-job" the steps the engine would report for an fp16 job whose
// second step overflows (S 65536 -> 32768), plus an evaluation, an RPC,
// device memory and a distributed job's rank so every family has a series,
// prints the bound port on one line and serves until stdin closes.
// prometheus_e2e_test.sh and validate_deploy.py scrape it.
//
//   metrics_fixture_server [listen_address]   (default 127.0.0.1:0)
#include <cstdio>
#include <iostream>
#include <string>

#include "server/engine/api.h"
#include "server/metrics/server_metrics.h"

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "127.0.0.1:0";
  auto started = ampd::metrics::ServerMetrics::Start(address);
  if (!started.ok()) {
    std::cerr << "metrics_fixture_server: " << started.status() << "\n";
    return 1;
  }
  ampd::metrics::ServerMetrics& metrics = **started;

  ampd::engine::JobConfig config;  // fp16, pytorch policy, init_scale 65536
  metrics.OnJobCreated("fixture-job", "", config);

  ampd::engine::StepReport step;
  step.step = 1;
  step.applied_steps = 1;
  step.loss = 0.75f;
  step.scaler = {.scale_before = 65536, .scale_after = 65536, .counters = {}};
  step.grad_norm = 2.0f;
  step.seconds = {
      .forward = 0.002, .backward = 0.004, .unscale = 0.001, .optimizer = 0.001, .total = 0.008};
  step.samples = 64;
  step.grad_histogram.assign(ampd::engine::kGradHistogramBins, 1);
  step.grad_underflow_fraction = 18.0 / ampd::engine::kGradHistogramBins;
  step.logprob_mismatch = 0.0f;  // an importance_sampling step on its own samples
  metrics.OnStep("fixture-job", step);

  // A job with per-layer loss scales: one gauge per layer group.
  ampd::engine::StepReport layered = step;
  layered.scaler.layer_scales_after = {16777216, 65536};
  metrics.OnStep("layered-job", layered);

  step.step = 2;  // overflow: skipped, S halved
  step.scaler = {.scale_before = 65536,
                 .scale_after = 32768,
                 .found_inf = true,
                 .skipped = true,
                 .backed_off = true,
                 .counters = {}};
  step.grad_norm.reset();
  metrics.OnStep("fixture-job", step);

  // A validation loss from an Evaluate call.
  ampd::engine::EvaluateReport evaluation;
  evaluation.loss = 0.8f;
  evaluation.samples = 64;
  evaluation.seconds = 0.003;
  metrics.OnEvaluate("fixture-job", evaluation);

  // A Sample call: two prompts, two completions each.
  ampd::engine::SampleReport sampled;
  sampled.completions.resize(2);
  for (auto& per_prompt : sampled.completions) per_prompt.resize(2);
  sampled.tokens = 24;
  sampled.seconds = 0.01;
  metrics.OnSample("fixture-job", sampled);

  // A tenant's job: its series carry a tenant label beside job.
  metrics.OnJobCreated("tenant-job", "team-a", config);
  metrics.OnStep("tenant-job", step);

  // Rank 1 of a two-rank distributed job: the allreduce and wait phases,
  // its rank and world size, and one formation that copied rank 0's state.
  ampd::engine::JobConfig distributed = config;
  distributed.distributed = {.world_size = 2,
                             .rank = 1,
                             .group = "fixture-group",
                             .rendezvous = "ampd-0:50052",
                             .timeout_ms = 30000,
                             .secret = "fixture-secret-0123456789"};
  metrics.OnJobCreated("dist-job", "", distributed);
  metrics.OnGroupFormed("dist-job",
                        {.round = 0, .copied_state = true, .source_rank = 0, .seconds = 0.2});
  step.seconds.allreduce = 0.003;
  step.seconds.wait = 0.001;
  metrics.OnStep("dist-job", step);

  metrics.RecordRpc("Step", "OK", 0.009);
  metrics.RpcInFlight("Sample").Increment();
  metrics.SetDeviceMemory(int64_t{1} << 30, int64_t{80} << 30);

  std::cout << metrics.port() << std::endl;  // endl: the reader waits for this line
  // Serve until the parent closes our stdin (or dies, which closes it too).
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}
