// libFuzzer target: Step from the wire into a live job. The bytes are a
// serialized StepRequest; its job_id picks one of two fixed jobs (fuzz_jobs.h),
// it is translated as the service does and stepped. Bad shapes, dtypes,
// ids and labels must be refused with a Status; a refused or skipped step
// must leave the job's weights and optimizer state bitwise unchanged;
// nothing may crash.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "server/engine/checkpoint/state_dict.h"
#include "server/rpc/translate.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {

bool SameTensors(const ampd::engine::checkpoint::StateDict& a,
                 const ampd::engine::checkpoint::StateDict& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].tensor.data != b.tensors[i].tensor.data) return false;
  }
  return true;
}

// Rows beyond this would only make the fuzzer slow, not find more.
constexpr int64_t kMaxRows = 4096;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ampd::v1::StepRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<ampd::engine::StepRequest> step = ampd::rpc::StepRequestFromProto(&request);
  if (!step.ok()) return 0;
  const ampd::engine::StepInput* input = &step->input;
  int64_t rows = 0;
  for (const auto& batch : input->micro_batches) {
    rows += batch.inputs.shape.empty() ? 0 : batch.inputs.shape[0];
  }
  if (rows > kMaxRows) return 0;
  ampd::engine::Trainer& trainer = ampd::fuzz::TrainerFor(ampd::fuzz::JobFor(request.job_id()));
  const int64_t steps_before = trainer.steps_run();
  absl::StatusOr<ampd::engine::checkpoint::StateDict> before = trainer.ExportState();
  ampd::fuzz::Check(before.ok(), "the job exports its state");
  absl::StatusOr<ampd::engine::StepReport> report = trainer.Step(*input);
  absl::StatusOr<ampd::engine::checkpoint::StateDict> after = trainer.ExportState();
  ampd::fuzz::Check(after.ok(), "the job exports its state after a step");
  if (!report.ok()) {
    ampd::fuzz::Check(trainer.steps_run() == steps_before, "a refused step leaves the count");
    ampd::fuzz::Check(SameTensors(*before, *after), "a refused step leaves the weights");
    return 0;
  }
  ampd::fuzz::Check(trainer.steps_run() == steps_before + 1, "an accepted step counts once");
  if (report->scaler.skipped) {
    ampd::fuzz::Check(SameTensors(*before, *after), "a skipped step leaves the weights");
  }
  // The pytorch policy may back the scale off to 0 after ~145 overflows in
  // a row, as PyTorch's does (every later step is then skipped); it never
  // becomes negative, inf or NaN.
  ampd::fuzz::Check(std::isfinite(trainer.scaler().scale) && trainer.scaler().scale >= 0.0f,
                    "the loss scale stays finite and non-negative");
  return 0;
}
