// Protobuf <-> engine translation: the rpc layer's whole vocabulary. What
// only the wire can get wrong (an enum value the proto does not define, NaN
// in a config's optional field, a tensor's byte length) is refused here,
// naming the request's field ("config.optimizer.lr",
// "micro_batches[1].targets"); the values are the engine's to check: a job
// call's request where the registry accepts it (api.h CheckRequest), its
// batches against the model on the job's strand, a config at CreateJob
// (its field names prefixed with "config.").
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "ampd/v1/trainer.pb.h"
#include "server/engine/api.h"
#include "server/engine/jobs/job_registry.h"
#include "server/rpc/wire.h"

namespace ampd::rpc {

// The effective engine config: the engine's defaults for the request's
// precision, scaler policy and optimizer kind with every field the request
// sets copied on top. Only what the wire can get wrong is checked here;
// the engine validates the result (JobRegistry::CreateJob,
// Trainer::Create).
absl::StatusOr<engine::JobConfig> JobConfigFromProto(const v1::JobConfig& proto);
// Every field set (the effective config CreateJob returns).
v1::JobConfig JobConfigToProto(const engine::JobConfig& config);

v1::Job JobToProto(const engine::JobSnapshot& snapshot);

// The micro-batches' tensor bytes are moved out of *request (a batch is
// megabytes; the request is not read again).
absl::StatusOr<engine::StepRequest> StepRequestFromProto(v1::StepRequest* request);
void StepReportToProto(const engine::StepReport& report, v1::StepResponse* response);

// Moves the tensor bytes out of *request, as StepRequestFromProto.
absl::StatusOr<engine::ForwardBackwardRequest> ForwardBackwardRequestFromProto(
    v1::ForwardBackwardRequest* request);
void ForwardBackwardReportToProto(const engine::ForwardBackwardReport& report,
                                  v1::ForwardBackwardResponse* response);
// Every field as sent.
engine::OptimStepRequest OptimStepRequestFromProto(const v1::OptimStepRequest& request);

// Moves the tensor bytes out of *request, as StepRequestFromProto.
absl::StatusOr<engine::EvaluateRequest> EvaluateRequestFromProto(v1::EvaluateRequest* request);
void EvaluateReportToProto(const engine::EvaluateReport& report, v1::EvaluateResponse* response);

// SampleRequest's fields with their defaults (num_samples 1, max_tokens 16,
// temperature 1, top_p 1).
engine::SampleRequest SampleRequestFromProto(const v1::SampleRequest& request);
void SampleReportToProto(const engine::SampleReport& report, v1::SampleResponse* response);
v1::SamplerSnapshot SamplerSnapshotToProto(const engine::SamplerSnapshotInfo& info);

// GetStateDictRequest.view: InvalidArgument naming "view" for a value the
// proto does not define.
absl::StatusOr<engine::StateView> StateViewFromProto(int view);

// Reads the ampd.create_request of a checkpoint written by an earlier ampd
// (a serialized CreateJobRequest): the registry's legacy decoder. New
// checkpoints carry the engine's own ampd.config instead.
absl::StatusOr<engine::JobConfigRecord> DecodeCreateRequest(absl::string_view bytes);

}  // namespace ampd::rpc
