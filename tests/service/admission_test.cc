// Memory admission through the real server: model sizes whose parameter
// count overflows int64 are INVALID_ARGUMENT, sizes larger than the machine
// or --max-memory-bytes are RESOURCE_EXHAUSTED, a Step whose activations do
// not fit --max-memory-bytes is RESOURCE_EXHAUSTED (an Evaluate's too), and
// after each the same
// ampd process still answers and trains (before, the first two killed it
// with std::length_error and std::bad_alloc on a worker thread). And the
// estimate holds: GPT steps of several shapes admitted at exactly their
// estimate grow the process's peak resident memory by no more than
// --max-memory-bytes; and a large-vocabulary GPT's Evaluate and Step hold
// the LM head in bounded chunks, their estimate within 20% of what they
// grow the process by.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::TempDir;

class AdmissionTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
  }

  void Start(std::vector<std::string> flags) {
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags,
                                            (root_.path() / "ampd.log").string());
    ASSERT_NE(server_->port(), 0) << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }

  // Linear(in, hidden), ReLU, LayerNorm(hidden), Linear(hidden, 2), fp16, MSE.
  static v1::CreateJobRequest Request(int64_t in, int64_t hidden) {
    v1::CreateJobRequest request;
    v1::ModelSpec* model = request.mutable_config()->mutable_model();
    v1::Linear* first = model->add_layers()->mutable_linear();
    first->set_in_features(in);
    first->set_out_features(hidden);
    model->add_layers()->mutable_relu();
    model->add_layers()->mutable_layer_norm()->set_normalized_shape(hidden);
    v1::Linear* last = model->add_layers()->mutable_linear();
    last->set_in_features(hidden);
    last->set_out_features(2);
    request.mutable_config()->set_precision(v1::PRECISION_FP16);
    request.mutable_config()->mutable_scaler()->set_init_scale(1024);
    return request;
  }

  static v1::Tensor F32(int64_t rows, int64_t cols, float value) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_F32);
    t.add_shape(rows);
    t.add_shape(cols);
    std::vector<float> v(static_cast<size_t>(rows * cols), value);
    t.set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
    return t;
  }

  static v1::StepRequest StepOf(const std::string& job_id, int64_t sequence, int64_t rows) {
    v1::StepRequest request;
    request.set_job_id(job_id);
    request.set_sequence(sequence);
    v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_inputs() = F32(rows, 2, 0.5f);
    *mb->mutable_targets() = F32(rows, 2, 0.25f);
    return request;
  }

  grpc::Status RawCreate(const v1::CreateJobRequest& request, v1::CreateJobResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return client_->stub().CreateJob(&context, request, response);
  }
  grpc::Status RawStep(const v1::StepRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StepResponse response;
    return client_->stub().Step(&context, request, &response);
  }

  // The server still creates a small job and trains it.
  void ExpectStillServing() {
    v1::CreateJobResponse created;
    grpc::Status s = RawCreate(Request(2, 64), &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(RawStep(StepOf(created.job().job_id(), 1, 16)).ok());
  }

  // A GPT (vocab, context = t, d_model, n_layer, n_head), fp16, and a
  // step's batch of (b, t) token ids.
  static v1::CreateJobRequest GptRequest(int64_t vocab, int64_t t, int64_t d_model, int64_t n_layer,
                                         int64_t n_head) {
    v1::CreateJobRequest request;
    v1::Gpt* gpt = request.mutable_config()->mutable_model()->mutable_gpt();
    gpt->set_vocab_size(vocab);
    gpt->set_context_length(t);
    gpt->set_d_model(d_model);
    gpt->set_n_layer(n_layer);
    gpt->set_n_head(n_head);
    request.mutable_config()->set_precision(v1::PRECISION_FP16);
    return request;
  }
  static v1::StepRequest GptStep(const std::string& job_id, int64_t sequence, int64_t vocab,
                                 int64_t b, int64_t t) {
    v1::StepRequest request;
    request.set_job_id(job_id);
    request.set_sequence(sequence);
    v1::MicroBatch* mb = request.add_micro_batches();
    std::vector<int32_t> ids(static_cast<size_t>(b * t));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % vocab);
    for (v1::Tensor* tensor : {mb->mutable_inputs(), mb->mutable_targets()}) {
      tensor->set_dtype(v1::DTYPE_I32);
      tensor->add_shape(b);
      tensor->add_shape(t);
      tensor->set_data(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
    }
    return request;
  }

  static v1::EvaluateRequest GptEvaluate(const std::string& job_id, int64_t vocab, int64_t b,
                                         int64_t t) {
    v1::EvaluateRequest request;
    request.set_job_id(job_id);
    *request.add_micro_batches() = GptStep(job_id, 1, vocab, b, t).micro_batches(0);
    return request;
  }
  // Evaluate and Step of a large batch: two cores may take a while.
  grpc::Status RawEvaluate(const v1::EvaluateRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    v1::EvaluateResponse response;
    return client_->stub().Evaluate(&context, request, &response);
  }
  grpc::Status LongStep(const v1::StepRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    v1::StepResponse response;
    return client_->stub().Step(&context, request, &response);
  }

  // /proc/<ampd>/status's `key` (VmRSS, VmHWM) in bytes; 0 when unread.
  int64_t ProcBytes(const std::string& key) const {
    std::ifstream status(absl::StrCat("/proc/", server_->pid(), "/status"));
    std::string line;
    while (std::getline(status, line)) {
      if (!absl::StartsWith(line, key + ":")) continue;
      int64_t kb = 0;
      std::string digits;
      for (char c : line) {
        if (c >= '0' && c <= '9') digits.push_back(c);
      }
      return absl::SimpleAtoi(digits, &kb) ? kb * 1024 : 0;
    }
    return 0;
  }

  // requested_bytes of a MEMORY_LIMIT refusal; 0 (and a failure) otherwise.
  static int64_t RequestedBytes(const grpc::Status& s) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    const std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(s);
    if (!info.has_value() || !info->metadata().contains("requested_bytes")) {
      ADD_FAILURE() << "no requested_bytes in " << s.error_message();
      return 0;
    }
    int64_t bytes = 0;
    EXPECT_TRUE(absl::SimpleAtoi(info->metadata().at("requested_bytes"), &bytes));
    return bytes;
  }

  TempDir root_{"ampd-admission-test"};
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(AdmissionTest, OversizedModelsAreRefusedAndTheServerLives) {
  Start({});  // no --max-memory-bytes: only the machine's memory bounds a job
  v1::CreateJobResponse response;
  grpc::Status s = RawCreate(Request(std::numeric_limits<int64_t>::max(), 64), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "layers[0]")) << s.error_message();
  s = RawCreate(Request(int64_t{1} << 31, 64), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  ExpectStillServing();
}

TEST_F(AdmissionTest, StepWorkspaceCountsAgainstMaxMemoryBytes) {
  Start({"--max-memory-bytes=33554432"});
  v1::CreateJobResponse created;
  grpc::Status s = RawCreate(Request(2, 64), &created);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string job_id = created.job().job_id();
  ASSERT_TRUE(RawStep(StepOf(job_id, 1, 256)).ok());
  // 65,536 rows: 1 MiB on the wire, ~50 MB of activations and buffers.
  s = RawStep(StepOf(job_id, 2, 65536));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-memory-bytes")) << s.error_message();
  // Nothing was applied: the same sequence number trains a usual batch.
  EXPECT_TRUE(RawStep(StepOf(job_id, 2, 256)).ok());
  s = RawCreate(Request(int64_t{1} << 31, 64), &created);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  ExpectStillServing();
}

TEST_F(AdmissionTest, EvaluateWorkspaceCountsAgainstMaxMemoryBytes) {
  Start({"--max-memory-bytes=33554432"});
  v1::CreateJobResponse created;
  grpc::Status s = RawCreate(Request(2, 64), &created);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string job_id = created.job().job_id();
  const auto evaluate = [&](int64_t rows) {
    v1::EvaluateRequest request;
    request.set_job_id(job_id);
    *request.add_micro_batches() = StepOf(job_id, 1, rows).micro_batches(0);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::EvaluateResponse response;
    return client_->stub().Evaluate(&context, request, &response);
  };
  EXPECT_TRUE(evaluate(256).ok());
  s = evaluate(65536);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-memory-bytes")) << s.error_message();
  // The job is untouched and trains from sequence 1.
  EXPECT_TRUE(RawStep(StepOf(job_id, 1, 256)).ok());
  ExpectStillServing();
}

// The shapes, scaled to a CPU test: (vocab 256, T 1024, d 64) as
// filed with 4 sequences instead of 32; a 32768-token vocabulary (the
// logits and the LM head dominate); a deeper model with several heads. For
// each, the estimate of the job's weights and of its step is read from the
// refusals of a server with too little room, then a server whose
// --max-memory-bytes is exactly their sum admits the job and two steps,
// and its peak resident memory (VmHWM) must not have grown by more than
// that limit since before the job: everything the step allocates (fp32
// staging of the 16-bit GEMMs, attention and loss rows, allocator
// rounding) is counted.
TEST_F(AdmissionTest, GptStepsStayWithinMaxMemoryBytes) {
  struct Shape {
    int64_t vocab, t, d_model, n_layer, n_head, b;
  };
  for (const Shape& shape : {Shape{256, 1024, 64, 1, 1, 4}, Shape{32768, 64, 32, 1, 2, 4},
                             Shape{1024, 128, 64, 2, 4, 8}}) {
    SCOPED_TRACE(absl::StrCat("vocab ", shape.vocab, ", T ", shape.t, ", d ", shape.d_model,
                              ", layers ", shape.n_layer, ", B ", shape.b));
    const v1::CreateJobRequest request =
        GptRequest(shape.vocab, shape.t, shape.d_model, shape.n_layer, shape.n_head);
    v1::CreateJobResponse created;
    Start({"--max-memory-bytes=1", "--worker-threads=2"});
    const int64_t weights = RequestedBytes(RawCreate(request, &created));
    ASSERT_GT(weights, 0);
    Start({absl::StrCat("--max-memory-bytes=", weights), "--worker-threads=2"});
    ASSERT_TRUE(RawCreate(request, &created).ok());
    const int64_t step =
        RequestedBytes(RawStep(GptStep(created.job().job_id(), 1, shape.vocab, shape.b, shape.t)));
    ASSERT_GT(step, 0);

    const int64_t limit = weights + step;
    Start({absl::StrCat("--max-memory-bytes=", limit), "--worker-threads=2"});
    const int64_t before = ProcBytes("VmRSS");
    ASSERT_GT(before, 0);
    grpc::Status s = RawCreate(request, &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (int64_t seq = 1; seq <= 2; ++seq) {
      s = RawStep(GptStep(created.job().job_id(), seq, shape.vocab, shape.b, shape.t));
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    const int64_t growth = ProcBytes("VmHWM") - before;
    std::fprintf(stderr, "limit %lld (weights %lld, step %lld), peak RSS growth %lld\n",
                 static_cast<long long>(limit), static_cast<long long>(weights),
                 static_cast<long long>(step), static_cast<long long>(growth));
    EXPECT_LE(growth, limit);
  }
}

// The large-vocabulary GPT at its own size: vocab 32000, a batch
// of 64 x 256 tokens, fp16 (d_model 64, two layers, so that the LM head
// dominates, as it does in the filed report). Its whole (N, V) logits are
// 1 GiB in fp16, and a CPU step widens them to fp32 twice: a head that is
// not chunked grows the process by gigabytes and an estimate that counts
// every GEMM operand at the logits' size says 12 GB. The batch runs in full
// (a few seconds on two cores): a smaller one would fit the head's bound
// in one chunk and show nothing. For Evaluate and for Step, each on a fresh
// server: the estimate (the job's weights, from a refused CreateJob, plus
// the call's, from a refused call) is what admission counts; the growth is
// the peak resident memory (VmHWM) since before the job was created. The
// growth stays within twice the estimate, and the estimate within 20% of
// the growth.
TEST_F(AdmissionTest, LargeVocabularyHeadIsChunkedAndItsEstimateHolds) {
  constexpr int64_t kVocab = 32000, kT = 256, kB = 64;
  const v1::CreateJobRequest request = GptRequest(kVocab, kT, 64, 2, 2);
  v1::CreateJobResponse created;
  Start({"--max-memory-bytes=1", "--worker-threads=2"});
  const int64_t weights = RequestedBytes(RawCreate(request, &created));
  ASSERT_GT(weights, 0);
  Start({absl::StrCat("--max-memory-bytes=", weights), "--worker-threads=2"});
  ASSERT_TRUE(RawCreate(request, &created).ok());
  const std::string refused_job = created.job().job_id();
  const int64_t evaluate = RequestedBytes(RawEvaluate(GptEvaluate(refused_job, kVocab, kB, kT)));
  const int64_t step = RequestedBytes(RawStep(GptStep(refused_job, 1, kVocab, kB, kT)));
  ASSERT_GT(evaluate, 0);
  ASSERT_GT(step, 0);

  for (const bool is_step : {false, true}) {
    SCOPED_TRACE(is_step ? "Step" : "Evaluate");
    const int64_t estimate = weights + (is_step ? step : evaluate);
    Start({absl::StrCat("--max-memory-bytes=", estimate), "--worker-threads=2"});
    const int64_t before = ProcBytes("VmRSS");
    ASSERT_GT(before, 0);
    grpc::Status s = RawCreate(request, &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const std::string job = created.job().job_id();
    s = is_step ? LongStep(GptStep(job, 1, kVocab, kB, kT))
                : RawEvaluate(GptEvaluate(job, kVocab, kB, kT));
    ASSERT_TRUE(s.ok()) << s.error_message();
    const int64_t growth = ProcBytes("VmHWM") - before;
    std::fprintf(stderr, "%s: estimate %lld (weights %lld), peak RSS growth %lld (%.2fx)\n",
                 is_step ? "Step" : "Evaluate", static_cast<long long>(estimate),
                 static_cast<long long>(weights), static_cast<long long>(growth),
                 static_cast<double>(growth) / static_cast<double>(estimate));
    EXPECT_LE(growth, 2 * estimate);
    EXPECT_LE(static_cast<double>(estimate), 1.2 * static_cast<double>(growth));
    EXPECT_GE(static_cast<double>(estimate), 0.8 * static_cast<double>(growth));
  }
}

}  // namespace
}  // namespace ampd
