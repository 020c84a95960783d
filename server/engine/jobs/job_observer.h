// The one narrow interface through which the engine reports to the outside
// (server/metrics implements it with prometheus-cpp; the engine never
// includes prometheus). Called from job workers, concurrently across jobs.
#pragma once

#include <cstdint>
#include <string>

#include "server/engine/api.h"

namespace ampd::engine {

class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // `tenant` is the job's owner ("" on a server without tenants); it never
  // changes, so observers may label everything of the job with it.
  virtual void OnJobCreated(const std::string& job_id, const std::string& tenant,
                            const JobConfig& config) = 0;
  virtual void OnStep(const std::string& job_id, const StepReport& report) = 0;
  virtual void OnEvaluate(const std::string& job_id, const EvaluateReport& report) = 0;
  // After a successful Sample.
  virtual void OnSample(const std::string& job_id, const SampleReport& report) = 0;
  virtual void OnJobDeleted(const std::string& job_id) = 0;
  // The ForwardBackward calls a job holds accumulated and not applied,
  // whenever that count changes (a call, an update, a drop). An update
  // also reports OnStep.
  virtual void OnAccumulated(const std::string& job_id, int64_t pending) {
    (void)job_id;
    (void)pending;
  }
  // The sampler snapshots a job holds and their device bytes, whenever
  // they change (a save, a delete, a restore, the job's end: 0 and 0).
  virtual void OnSamplerSnapshots(const std::string& job_id, int64_t count, int64_t bytes) {
    (void)job_id;
    (void)count;
    (void)bytes;
  }
  // The base models LoRA jobs share now (BaseModels) and their bytes,
  // after each change of the jobs (a create, a delete, a restore).
  virtual void OnSharedBases(int64_t count, int64_t bytes) {
    (void)count;
    (void)bytes;
  }
  // A distributed job's rank formed its group (before the step that needed
  // it). Most observers have no use for it.
  virtual void OnGroupFormed(const std::string& job_id, const GroupFormation& formation) {
    (void)job_id;
    (void)formation;
  }
};

}  // namespace ampd::engine
