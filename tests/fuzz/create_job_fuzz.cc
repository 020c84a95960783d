// libFuzzer target: CreateJob from the wire to a built job. The bytes are a
// serialized CreateJobRequest; it is translated and validated as the
// service does (rpc translates, the engine validates), its memory estimated, and, when the estimate
// is admitted under a small limit, the job is built on the CPU backend. No input may crash,
// overflow a size or allocate past the limit (libFuzzer's -malloc_limit_mb catches an allocation
// the estimate did not admit).
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/backend_factory.h"
#include "server/engine/jobs/job.h"
#include "server/engine/trainer/trainer.h"
#include "server/rpc/translate.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {
// Jobs estimated above this are refused here, as --max-memory-bytes would.
constexpr int64_t kAdmittedBytes = int64_t{16} << 20;
// What a trainer holds beside the estimate (weights, gradients, optimizer
// state): the step's one-element scalars and the gradient histogram.
constexpr int64_t kTrainerFixedBytes = int64_t{4} << 10;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ampd::v1::CreateJobRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<ampd::engine::JobConfig> config = ampd::rpc::JobConfigFromProto(request.config());
  if (!config.ok()) return 0;
  // The engine's validation, as the registry runs it on every create.
  if (!ampd::engine::ValidateJobConfig(*config).ok()) return 0;
  const int64_t estimate = ampd::engine::EstimateJobBytes(*config);
  ampd::fuzz::Check(estimate > 0, "an admitted config has a positive estimate");
  if (estimate > kAdmittedBytes) return 0;
  absl::StatusOr<std::unique_ptr<ampd::kernels::Backend>> backend =
      ampd::kernels::CreateBackend("cpu");
  ampd::fuzz::Check(backend.ok(), "the CPU backend");
  absl::StatusOr<std::unique_ptr<ampd::engine::Trainer>> trainer =
      ampd::engine::Trainer::Create(*config, *std::move(backend));
  ampd::fuzz::Check(trainer.ok(), "a valid, admitted config builds");
  ampd::fuzz::Check((*trainer)->backend().BytesInUse() <= estimate + kTrainerFixedBytes,
                    "a built job holds no more than its estimate");
  return 0;
}
