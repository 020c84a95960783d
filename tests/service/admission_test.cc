// Memory admission through the real server: model sizes whose parameter
// count overflows int64 are INVALID_ARGUMENT, sizes larger than the machine
// or --max-memory-bytes are RESOURCE_EXHAUSTED, a Step whose activations do
// not fit --max-memory-bytes is RESOURCE_EXHAUSTED (an Evaluate's too), and
// after each the same
// ampd process still answers and trains (before, the first two killed it
// with std::length_error and std::bad_alloc on a worker thread).
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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
  Start({"--max-memory-bytes=4194304"});
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
  Start({"--max-memory-bytes=4194304"});
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

}  // namespace
}  // namespace ampd
