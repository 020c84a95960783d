// Memory admission: sizes from a client are checked before anything is
// allocated. A spec whose parameter count overflows is InvalidArgument; one
// too large for the machine is ResourceExhausted (not std::length_error or
// std::bad_alloc on a worker thread); a Step's activation and workspace
// memory is estimated exactly as the CPU backend allocates it and counted
// with the jobs' weights against --max-memory-bytes; a step's workspaces
// stay cached (and counted) after it until memory pressure or the job's
// deletion frees them.
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/error_reason.h"
#include "engine_test_util.h"
#include "server/engine/jobs/job.h"
#include "server/engine/jobs/job_registry.h"
#include "server/engine/model/layers.h"
#include "server/engine/model/lm_head.h"

namespace ampd::engine {
namespace {

using model::LayerKind;
using model::Precision;
using namespace ampd::engine::testing;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

JobConfig Mlp(int64_t in, int64_t hidden, int64_t out) {
  JobConfig config = DefaultJobConfig(Precision::kFp16);
  config.model.layers = {Linear(in, hidden), Act(LayerKind::kReLU), LayerNorm(hidden),
                         Linear(hidden, out)};
  config.scaler.init_scale = 1024.0;
  return config;
}

MicroBatch Batch(int64_t rows, int64_t in, int64_t out) {
  DataRng rng(static_cast<uint64_t>(rows));
  MicroBatch mb;
  mb.inputs = F32({rows, in}, rng.UniformVector(static_cast<size_t>(rows * in), -1, 1));
  mb.targets = F32({rows, out}, rng.UniformVector(static_cast<size_t>(rows * out), -1, 1));
  return mb;
}

StepInput One(MicroBatch mb) {
  StepInput in;
  in.micro_batches.push_back(std::move(mb));
  return in;
}

// What a CPU job holds beside a step's workspaces, for batches of at most
// `rows` rows of `config`'s model whose workspaces total `tensor_bytes`:
// the backend's scratch (kernels::Backend::ScratchBytes), counted with them.
int64_t Scratch(const JobConfig& config, int64_t rows, int64_t tensor_bytes) {
  static const auto* const cpu = kernels::CreateBackend("cpu")->release();
  const int64_t in = config.model.layers.front().in_features;
  return cpu->ScratchBytes(model::StepScratchExtents(config.model, config.precision, {rows, in}),
                           tensor_bytes);
}

TEST(Admission, ParameterCountOverflowIsInvalidArgument) {
  struct Case {
    std::vector<model::LayerSpec> layers;
    std::string names;
  };
  const std::vector<Case> cases = {
      {{Linear(kInt64Max, 64)}, "layers[0]"},
      {{Linear(64, kInt64Max)}, "layers[0]"},
      {{Linear(int64_t{1} << 32, int64_t{1} << 32)}, "layers[0]"},  // 2^64
      {{Embedding(int64_t{1} << 40, int64_t{1} << 30)}, "layers[0]"},
      {{LayerNorm(kInt64Max)}, "layers[0]"},
      // Each layer fits, the sum does not.
      {{Linear(1, int64_t{1} << 55), Linear(int64_t{1} << 55, 1)}, "layers"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.names);
    JobConfig config = DefaultJobConfig(Precision::kFp16);
    config.model.layers = c.layers;
    const absl::Status s = ValidateJobConfig(config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(c.names), std::string::npos) << s;
    // Estimates saturate instead of wrapping to something small.
    EXPECT_GT(EstimateJobBytes(config), int64_t{1} << 56);
    auto backend = kernels::CreateBackend("cpu");
    ASSERT_TRUE(backend.ok());
    auto trainer = Trainer::Create(config, *std::move(backend));
    EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument) << trainer.status();
  }
}

// A batch shape whose byte count wraps int64 (2^62 x 4 floats is 2^66
// bytes, 0 once wrapped) must not match an empty buffer.
TEST(Admission, HostTensorByteCountOverflowIsInvalidArgument) {
  for (const kernels::Shape& shape :
       {kernels::Shape{int64_t{1} << 62, 4}, kernels::Shape{int64_t{1} << 61, 0, 1},
        kernels::Shape{int64_t{1} << 32, int64_t{1} << 32}, kernels::Shape{kInt64Max, 2}}) {
    HostTensor t;
    t.dtype = kernels::DType::kF32;
    t.shape = shape;
    const absl::Status s = t.Validate("micro_batches[0].inputs");
    if (kernels::NumElements(shape) == 0 && shape[1] == 0) {
      EXPECT_TRUE(s.ok()) << s;  // zero elements: 0 bytes is right
      continue;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << kernels::ShapeToString(shape);
    EXPECT_NE(std::string(s.message()).find("micro_batches[0].inputs"), std::string::npos) << s;
  }
  JobConfig config = DefaultJobConfig(Precision::kFp16);
  config.model.layers = {Linear(4, 2)};
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  StepInput in;
  in.micro_batches.resize(1);
  in.micro_batches[0].inputs.shape = {int64_t{1} << 62, 4};
  in.micro_batches[0].targets.shape = {int64_t{1} << 62, 2};
  EXPECT_EQ(t->Step(in).status().code(), absl::StatusCode::kInvalidArgument);
}

// 2^31 x 64 is a valid shape of 2^37 parameters (2.7 TB with AdamW): more
// than the machine has, refused before any allocation instead of a 512 GiB
// host vector throwing std::bad_alloc.
TEST(Admission, WeightsLargerThanTheDeviceAreResourceExhausted) {
  for (const auto& layers :
       {std::vector<model::LayerSpec>{Linear(int64_t{1} << 31, 64)},
        std::vector<model::LayerSpec>{Embedding(int64_t{1} << 31, 64), Linear(64, 2)}}) {
    JobConfig config = DefaultJobConfig(Precision::kFp16);
    config.model.layers = layers;
    ASSERT_TRUE(ValidateJobConfig(config).ok());
    auto backend = kernels::CreateBackend("cpu");
    ASSERT_TRUE(backend.ok());
    ASSERT_GT((*backend)->MemoryCapacityBytes(), 0);
    ASSERT_GT(EstimateJobBytes(config), (*backend)->MemoryCapacityBytes());
    auto trainer = Trainer::Create(config, *std::move(backend));
    EXPECT_EQ(trainer.status().code(), absl::StatusCode::kResourceExhausted) << trainer.status();
    EXPECT_NE(std::string(trainer.status().message()).find("bytes"), std::string::npos);
  }
}

// The estimate is what the CPU backend allocates for an fp16 MSE job fed
// F32 inputs (every buffer it counts is allocated, at the dtype it assumes).
TEST(Admission, WorkspaceEstimateIsWhatAStepAllocates) {
  const JobConfig config = Mlp(6, 16, 3);
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  const int64_t before = t->backend().BytesInUse();
  ASSERT_TRUE(t->Step(One(Batch(37, 6, 3))).ok());
  auto bytes = model::WorkspaceBytes(config.model, config.precision, 37);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(t->backend().BytesInUse() - before, *bytes);
  // Counted with the backend's scratch (fp32 staging of the fp16 GEMMs).
  ASSERT_GT(Scratch(config, 37, *bytes), 0);
  EXPECT_EQ(t->workspace_bytes(), *bytes + Scratch(config, 37, *bytes));
  // acts 6,16,16,16,3 and grads 16,16,16,3 in fp16, 2 LayerNorm stats, F32
  // staging (N, 6) and targets (N, 3).
  EXPECT_EQ(*bytes, 37 * ((6 + 16 * 3 + 3) * 2 + (16 * 3 + 3) * 2 + 2 * 4 + 6 * 4 + 3 * 4));
  // A second size is added to the cache; a step that no longer uses the
  // first frees it.
  StepInput two;
  two.micro_batches = {Batch(37, 6, 3), Batch(5, 6, 3)};
  ASSERT_TRUE(t->Step(two).ok());
  auto five = model::WorkspaceBytes(config.model, config.precision, 5);
  ASSERT_TRUE(five.ok());
  const int64_t scratch = Scratch(config, 37, *bytes + *five);
  EXPECT_EQ(t->workspace_bytes(), *bytes + *five + scratch);
  // The scratch stays at the largest size run until released.
  ASSERT_TRUE(t->Step(One(Batch(5, 6, 3))).ok());
  EXPECT_EQ(t->workspace_bytes(), *five + scratch);
  EXPECT_EQ(t->backend().BytesInUse() - before, *five);
  // Rows whose byte count overflows int64 are refused by the estimate.
  EXPECT_EQ(model::WorkspaceBytes(config.model, config.precision, kInt64Max / 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A sampler's estimate counts its decode steps' head, one (S, V) GEMM over
// every sequence, beside the prompts' forward, whose head runs in chunks of
// fewer rows once the (S P, V) logits pass kLmHeadChunkBytes: here 3000
// sequences of a 50000-token vocabulary in bf16 (300 MB of decode logits;
// the prefill's chunks are 2000 rows). The call is refused at admission, so
// nothing of that size is allocated.
TEST(Admission, ASamplersEstimateCountsItsDecodeStepsHead) {
  JobConfig config = DefaultJobConfig(Precision::kBf16);
  model::GptSpec g;
  g.vocab_size = 50000;
  g.context_length = 8;
  g.d_model = 32;
  g.n_layer = 1;
  g.n_head = 4;
  config.model.kind = g;
  config.model.loss = model::LossKind::kCrossEntropy;
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  SampleInput in;
  in.prompts.assign(1000, {1, 2});
  in.num_samples = 3;
  in.max_tokens = 2;
  const int64_t n = 3000, prompt = 2, max_len = 3;
  int64_t admitted = 0;
  const auto refuse = [&admitted](int64_t need) {
    admitted = need;
    return absl::ResourceExhaustedError("measured");
  };
  ASSERT_EQ(t->Sample(in, refuse).status().code(), absl::StatusCode::kResourceExhausted);

  // The estimate as the sampler forms it: the prefill's workspace and the
  // scratch of its ops and the decode steps', the decode state, the (S, V)
  // logits and the draw's scratch, 112 bytes a sequence and the prompts'
  // host ids and targets.
  kernels::Backend& b = t->backend();
  auto ws = model::WorkspaceBytes(config.model, config.precision, {n, prompt});
  ASSERT_TRUE(ws.ok()) << ws.status();
  kernels::ScratchExtents prefill =
      model::StepScratchExtents(config.model, config.precision, {n, prompt}, /*backward=*/false);
  ASSERT_LT(model::LmHeadChunkRows(g.vocab_size, config.precision, n * prompt), n);
  kernels::ScratchExtents extents = prefill;
  model::WidenExtents(model::DecodeScratchExtents(config.model, config.precision, n), extents);
  ASSERT_GT(b.ScratchBytes(extents, *ws), b.ScratchBytes(prefill, *ws));
  auto cpu = kernels::CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  auto net = model::CreateNetwork(config.model, config.precision, 1, **cpu);
  ASSERT_TRUE(net.ok()) << net.status();
  auto state = (*net)->DecodeStateBytes(n, max_len);
  ASSERT_TRUE(state.ok()) << state.status();
  const int64_t extra = *state + n * g.vocab_size * 2 + b.SampleScratchBytes(n, g.vocab_size) +
                        n * 112 + n * prompt * 16;
  EXPECT_EQ(admitted, *ws + b.ScratchBytes(extents, *ws) + extra);
}

// A step's buffers stay cached for the next step of the same sizes, however
// large (a GPT-2 step's are gigabytes): a warm step allocates no tensor at
// all, and the job frees them when asked (memory pressure, deletion).
TEST(Admission, WorkspaceStaysCachedAndAWarmStepAllocatesNothing) {
  const JobConfig config = Mlp(4, 512, 2);
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  const int64_t weights = t->backend().BytesInUse();
  const int64_t rows = 16384;
  auto big = model::WorkspaceBytes(config.model, config.precision, rows);
  ASSERT_TRUE(big.ok());
  ASSERT_GT(*big, int64_t{64} << 20);
  const MicroBatch batch = Batch(rows, 4, 2);
  ASSERT_TRUE(t->Step(One(batch)).ok());
  const int64_t held = *big + Scratch(config, rows, *big);
  EXPECT_EQ(t->workspace_bytes(), held);
  EXPECT_EQ(t->backend().BytesInUse() - weights, *big);
  const int64_t allocations = t->backend().AllocationCount();
  for (int i = 0; i < 2; ++i) {
    auto r = t->Step(One(batch));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(t->backend().AllocationCount(), allocations) << "a warm step allocated";
  EXPECT_EQ(t->workspace_bytes(), held);
  // An evaluation of the same size runs on the same buffers.
  EvaluateInput eval;
  eval.micro_batches.push_back(batch);
  ASSERT_TRUE(t->Evaluate(eval).ok());
  EXPECT_EQ(t->backend().AllocationCount(), allocations);
  t->ReleaseWorkspaces();
  EXPECT_EQ(t->workspace_bytes(), 0);
  EXPECT_EQ(t->backend().BytesInUse(), weights);
}

// The process's address space now, in bytes (/proc/self/statm's first
// field, in pages).
int64_t AddressSpaceBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long long pages = -1;
  const int read = std::fscanf(f, "%lld", &pages);
  std::fclose(f);
  return read == 1 ? pages * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE)) : -1;
}

// An allocation that fails for lack of memory asks the memory-pressure
// handler to free memory held elsewhere and is retried once. Here the
// memory is short because the address space is capped (RLIMIT_AS) a few
// MiB above what the process holds, and "elsewhere" lifts the cap: the
// step's 70 MB workspace fails, the handler runs once, the retry succeeds.
// A step whose allocations succeed never calls it.
TEST(Admission, AFailedWorkspaceAllocationIsRetriedOnceAfterRelief) {
  const JobConfig config = Mlp(4, 512, 2);
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  int relieved = 0;
  struct rlimit saved {};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &saved), 0);
  t->SetMemoryPressureHandler([&] {
    ++relieved;
    EXPECT_EQ(setrlimit(RLIMIT_AS, &saved), 0);
  });
  ASSERT_TRUE(t->Step(One(Batch(64, 4, 2))).ok());  // warm: threads, scratch
  EXPECT_EQ(relieved, 0);
  const MicroBatch big = Batch(16384, 4, 2);
  const int64_t held = AddressSpaceBytes();
  ASSERT_GT(held, 0);
  struct rlimit capped = saved;
  capped.rlim_cur = static_cast<rlim_t>(held + (int64_t{4} << 20));
  if (saved.rlim_cur != RLIM_INFINITY && saved.rlim_cur < capped.rlim_cur) {
    GTEST_SKIP() << "RLIMIT_AS is already below what the test would set";
  }
  ASSERT_EQ(setrlimit(RLIMIT_AS, &capped), 0);
  absl::StatusOr<StepReport> r = t->Step(One(big));
  ASSERT_EQ(setrlimit(RLIMIT_AS, &saved), 0);
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(relieved, 1);
  const int64_t workspace = model::WorkspaceBytes(config.model, config.precision, 16384).value();
  EXPECT_EQ(t->workspace_bytes(), workspace + Scratch(config, 16384, workspace));
}

// A Trainer's admit hook sees the whole step's workspace before anything is
// allocated, and its refusal leaves the job exactly as it was.
TEST(Admission, RefusedStepChangesNothing) {
  const JobConfig config = Mlp(6, 16, 3);
  auto t = MakeTrainer(config);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->Step(One(Batch(8, 6, 3))).ok());
  auto state = t->ExportState();
  ASSERT_TRUE(state.ok());
  const int64_t in_use = t->backend().BytesInUse();
  int64_t asked = -1;
  auto r = t->Step(One(Batch(4096, 6, 3)), [&](int64_t bytes) {
    asked = bytes;
    return absl::ResourceExhaustedError("over the limit");
  });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  auto want = model::WorkspaceBytes(config.model, config.precision, 4096);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(asked, *want + Scratch(config, 4096, *want));
  EXPECT_LE(t->backend().BytesInUse(), in_use);
  auto after = t->ExportState();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(StateDiff(*state, *after), "");
}

// Through the registry, as the service runs it: a 32 MiB limit admits a
// small job and its usual steps (with the CPU backend's scratch, some
// 9 MiB), refuses a 65,536-row step with RESOURCE_EXHAUSTED, and still
// runs the next usual step.
TEST(Admission, RegistryCountsStepWorkspaceAgainstMaxMemoryBytes) {
  RegistryOptions options;
  options.max_memory_bytes = int64_t{32} << 20;
  options.worker_threads = 1;
  auto registry = JobRegistry::Create(options);
  ASSERT_TRUE(registry.ok()) << registry.status();
  const JobConfig config = Mlp(2, 64, 2);
  ASSERT_LT(EstimateJobBytes(config), int64_t{1} << 20);

  std::promise<absl::StatusOr<JobSnapshot>> created;
  (*registry)->CreateJob("", config, "",
                         [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
  absl::StatusOr<JobSnapshot> job = created.get_future().get();
  ASSERT_TRUE(job.ok()) << job.status();

  auto step = [&](int64_t sequence, int64_t rows) {
    std::promise<absl::StatusOr<StepReport>> done;
    (*registry)->Submit("", job->job_id, StepRequest{sequence, One(Batch(rows, 2, 2))},
                        [&](absl::StatusOr<StepReport> r) { done.set_value(std::move(r)); });
    return done.get_future().get();
  };
  ASSERT_TRUE(step(1, 256).ok());
  absl::StatusOr<StepReport> big = step(2, 65536);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(std::string(big.status().message()).find("--max-memory-bytes"), std::string::npos)
      << big.status();
  auto snapshot = (*registry)->GetJob("", job->job_id);
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(snapshot->step, 1);
  absl::StatusOr<StepReport> next = step(2, 256);
  EXPECT_TRUE(next.ok()) << next.status();

  // The cached workspace counts against a new job too.
  JobConfig second = Mlp(2, 64, 2);
  std::promise<absl::StatusOr<JobSnapshot>> created2;
  (*registry)->CreateJob("", second, "",
                         [&](absl::StatusOr<JobSnapshot> s) { created2.set_value(std::move(s)); });
  EXPECT_TRUE(created2.get_future().get().ok());
  (*registry)->Shutdown();
}

// Memory pressure through the registry: two jobs whose weights and one
// step's workspace fit --max-memory-bytes, but not two workspaces. Each
// job's workspace stays cached (and counted) after its step; the other
// job's step, refused on the count, makes the idle job give its workspace
// up and is then admitted. Deleting a job frees its workspace for the next.
TEST(Admission, MemoryPressureReleasesAnIdleJobsWorkspace) {
  const JobConfig config = Mlp(2, 64, 2);
  const int64_t rows = 8192;
  const int64_t weights = EstimateJobBytes(config);
  const int64_t tensors = model::WorkspaceBytes(config.model, config.precision, rows).value();
  // Admission counts the backend's scratch with the workspace; the device
  // memory report, the tensors alone.
  const int64_t workspace = tensors + Scratch(config, rows, tensors);
  RegistryOptions options;
  options.max_memory_bytes = 2 * weights + workspace + workspace / 2;
  options.worker_threads = 2;
  absl::Mutex mu;
  int64_t reported = -1;  // the registry's last device-memory report
  options.on_device_memory = [&](int64_t bytes) {
    absl::MutexLock lock(&mu);
    reported = bytes;
  };
  auto last_report = [&] {
    absl::MutexLock lock(&mu);
    return reported;
  };
  auto registry = JobRegistry::Create(options);
  ASSERT_TRUE(registry.ok()) << registry.status();
  auto create = [&] {
    std::promise<absl::StatusOr<JobSnapshot>> created;
    (*registry)->CreateJob("", config, "",
                           [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
    return created.get_future().get();
  };
  auto step = [&](const std::string& job_id, int64_t sequence) {
    std::promise<absl::StatusOr<StepReport>> done;
    (*registry)->Submit("", job_id, StepRequest{sequence, One(Batch(rows, 2, 2))},
                        [&](absl::StatusOr<StepReport> r) { done.set_value(std::move(r)); });
    return done.get_future().get();
  };
  absl::StatusOr<JobSnapshot> a = create();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<JobSnapshot> b = create();
  ASSERT_TRUE(b.ok()) << b.status();
  const int64_t both_weights = last_report();

  absl::StatusOr<StepReport> r = step(a->job_id, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(last_report(), both_weights + tensors);  // a's stays cached
  // b's step needs a second workspace the limit cannot hold beside a's:
  // a, idle, gives its up, and b's is admitted.
  r = step(b->job_id, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(last_report(), both_weights + tensors);  // b's now, a's freed
  // And back: b's cached workspace goes for a's next step.
  r = step(a->job_id, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(last_report(), both_weights + tensors);

  // A third job's weights fit beside both jobs' weights only once a, idle,
  // gives up its cached workspace.
  // About h^2 parameters at 16 bytes each (fp16 AdamW): about a workspace.
  JobConfig third = DefaultJobConfig(Precision::kFp16);
  const auto h = static_cast<int64_t>(std::sqrt(static_cast<double>(workspace) / 16.0));
  third.model.layers = {Linear(2, h), Linear(h, h)};
  const int64_t third_bytes = EstimateJobBytes(third);
  ASSERT_GT(third_bytes, options.max_memory_bytes - 2 * weights - workspace);
  ASSERT_LE(third_bytes, options.max_memory_bytes - 2 * weights);
  std::promise<absl::StatusOr<JobSnapshot>> created;
  (*registry)->CreateJob("", third, "",
                         [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
  absl::StatusOr<JobSnapshot> c = created.get_future().get();
  ASSERT_TRUE(c.ok()) << c.status();
  auto remove = [&](const std::string& job_id) {
    std::promise<absl::Status> deleted;
    (*registry)->DeleteJob("", job_id, [&](absl::Status s) { deleted.set_value(s); });
    return deleted.get_future().get();
  };
  ASSERT_TRUE(remove(c->job_id).ok());
  EXPECT_EQ(last_report(), both_weights);  // nothing cached any more

  // Deleting a job frees its workspace with it: b steps (caching its
  // workspace), and once b is deleted the report is a's weights alone.
  r = step(b->job_id, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(last_report(), both_weights + tensors);
  ASSERT_TRUE(remove(b->job_id).ok());
  EXPECT_EQ(last_report(), both_weights / 2);
  (*registry)->Shutdown();
}

// A job gives up its cached workspace only while it is idle: inside a step
// it keeps it (ReleaseWorkspacesIfIdle returns 0 at once and touches
// nothing); idle, it frees it and stops counting it; closed, it holds none.
// A Job takes its input as the registry hands it over: checked.
Valid<StepRequest> Checked(int64_t sequence, StepInput input) {
  return Valid<StepRequest>::Check(StepRequest{sequence, std::move(input)}).value();
}

TEST(Admission, OnlyAnIdleJobGivesUpItsWorkspace) {
  WorkerPool pool(1);
  JobContext context;
  context.pool = &pool;
  // The second step's admission waits for the test: the step is then
  // running, its cached workspace about to be used.
  std::promise<void> admitting, admit;
  std::shared_future<void> admitted = admit.get_future().share();
  int admissions = 0;
  context.admit_step = [&](Job&, int64_t) -> absl::StatusOr<WorkspaceReservation> {
    if (++admissions == 2) {
      admitting.set_value();
      admitted.wait();
    }
    return WorkspaceReservation();
  };
  absl::StatusOr<ValidJobConfig> valid = ValidJobConfig::Check(Mlp(2, 64, 2));
  ASSERT_TRUE(valid.ok()) << valid.status();
  auto job = std::make_shared<Job>("job-test", "", "", *std::move(valid), &context);
  auto run = [&](std::function<void()> task) {
    std::promise<void> done;
    job->Post([&] {
      task();
      done.set_value();
    });
    done.get_future().wait();
  };
  run([&] { ASSERT_TRUE(job->Initialize("cpu").ok()); });
  run([&] { ASSERT_TRUE(job->Run(Checked(1, One(Batch(4096, 2, 2)))).ok()); });
  const int64_t workspace = job->workspace_bytes();
  const int64_t tensors =
      model::WorkspaceBytes(Mlp(2, 64, 2).model, Precision::kFp16, 4096).value();
  ASSERT_EQ(workspace, tensors + Scratch(Mlp(2, 64, 2), 4096, tensors));

  std::promise<void> stepped;
  job->Post([&] {
    EXPECT_TRUE(job->Run(Checked(2, One(Batch(4096, 2, 2)))).ok());
    stepped.set_value();
  });
  admitting.get_future().wait();
  EXPECT_EQ(job->ReleaseWorkspacesIfIdle(), 0);
  EXPECT_EQ(job->workspace_bytes(), workspace);
  admit.set_value();
  stepped.get_future().wait();

  // Between tasks, or in a task that is not a step: freed.
  EXPECT_EQ(job->ReleaseWorkspacesIfIdle(), workspace);
  EXPECT_EQ(job->workspace_bytes(), 0);
  EXPECT_EQ(job->ReleaseWorkspacesIfIdle(), 0);  // nothing left
  // The next step allocates afresh.
  run([&] { ASSERT_TRUE(job->Run(Checked(3, One(Batch(4096, 2, 2)))).ok()); });
  EXPECT_EQ(job->workspace_bytes(), workspace);
  run([&] { ASSERT_TRUE(job->Close(/*remove_checkpoint=*/false).ok()); });
  EXPECT_EQ(job->workspace_bytes(), 0);
  EXPECT_EQ(job->bytes_in_use(), 0);
  EXPECT_EQ(job->ReleaseWorkspacesIfIdle(), 0);
  pool.Shutdown();
}

// A tenant's max_memory_bytes bounds its own jobs' steps the same way, while
// another tenant, with no quota, steps the same batch on the same server.
TEST(Admission, TenantMemoryQuotaBoundsItsStepsOnly) {
  RegistryOptions options;
  options.worker_threads = 1;
  options.tenant_quotas["alice"] = {.max_jobs = 0, .max_memory_bytes = int64_t{32} << 20};
  auto registry = JobRegistry::Create(options);
  ASSERT_TRUE(registry.ok()) << registry.status();
  auto create = [&](const std::string& owner) {
    std::promise<absl::StatusOr<JobSnapshot>> created;
    (*registry)->CreateJob(owner, Mlp(2, 64, 2), "",
                           [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
    return created.get_future().get();
  };
  auto step = [&](const std::string& owner, const std::string& job_id, int64_t rows) {
    std::promise<absl::StatusOr<StepReport>> done;
    (*registry)->Submit(owner, job_id, StepRequest{1, One(Batch(rows, 2, 2))},
                        [&](absl::StatusOr<StepReport> r) { done.set_value(std::move(r)); });
    return done.get_future().get();
  };
  absl::StatusOr<JobSnapshot> alices = create("alice");
  ASSERT_TRUE(alices.ok()) << alices.status();
  absl::StatusOr<JobSnapshot> bobs = create("bob");
  ASSERT_TRUE(bobs.ok()) << bobs.status();

  absl::StatusOr<StepReport> big = step("alice", alices->job_id, 65536);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  const std::optional<ErrorReason> why = GetErrorReason(big.status());
  ASSERT_TRUE(why.has_value()) << big.status();
  EXPECT_EQ(why->reason, reason::kMemoryLimit);
  EXPECT_EQ(why->metadata.at("tenant"), "alice");
  EXPECT_TRUE(step("bob", bobs->job_id, 65536).ok());
  EXPECT_TRUE(step("alice", alices->job_id, 256).ok());
  // Neither sees the other's job.
  EXPECT_EQ((*registry)->GetJob("bob", alices->job_id).status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<JobPage> page = (*registry)->ListJobs("alice", 0, "");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->jobs.size(), 1u);
  EXPECT_EQ(page->jobs[0].job_id, alices->job_id);
  (*registry)->Shutdown();
}

}  // namespace
}  // namespace ampd::engine
