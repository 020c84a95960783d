// The fuzz targets' fixed jobs (fuzz_jobs.h).
#include "tests/fuzz/fuzz_jobs.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/backend_factory.h"
#include "server/rpc/translate.h"

namespace ampd::fuzz {
namespace {

// MLP: (N, 8) -> Linear 16 -> GELU -> LayerNorm -> Linear 4, MSE.
// Embedding: ids (N) in [0, 32) -> (N, 8) -> Linear 32, cross-entropy.
constexpr int kMlpIn = 8;
constexpr int kMlpOut = 4;
constexpr int kVocab = 32;
// GPT: vocab 32, context 8, d_model 8, 1 layer, 2 heads; sequences of 4.
constexpr int kGptSeq = 4;

v1::Layer LinearLayer(int in, int out) {
  v1::Layer layer;
  layer.mutable_linear()->set_in_features(in);
  layer.mutable_linear()->set_out_features(out);
  return layer;
}

v1::Tensor FloatTensor(std::vector<int64_t> shape, float start) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  int64_t count = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    count *= d;
  }
  std::vector<float> values(static_cast<size_t>(count));
  for (size_t i = 0; i < values.size(); ++i) values[i] = start + 0.01f * static_cast<float>(i % 97);
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

v1::Tensor IdTensor(int rows, int limit) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_I32);
  t.add_shape(rows);
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int i = 0; i < rows; ++i) ids[static_cast<size_t>(i)] = (i * 7) % limit;
  t.set_data(ids.data(), ids.size() * sizeof(int32_t));
  return t;
}

// (rows, kGptSeq) I64 token ids below kVocab.
v1::Tensor SequenceTensor(int rows, int shift) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_I64);
  t.add_shape(rows);
  t.add_shape(kGptSeq);
  std::vector<int64_t> ids(static_cast<size_t>(rows * kGptSeq));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 5 + shift) % kVocab);
  t.set_data(ids.data(), ids.size() * sizeof(int64_t));
  return t;
}

std::unique_ptr<engine::Trainer> Build(FuzzJob job) {
  absl::StatusOr<engine::JobConfig> config =
      rpc::JobConfigFromProto(CreateRequestFor(job).config());
  if (!config.ok()) {
    std::fprintf(stderr, "fuzz job config: %s\n", config.status().ToString().c_str());
    std::abort();
  }
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  Check(backend.ok(), "the CPU backend");
  absl::StatusOr<std::unique_ptr<engine::Trainer>> trainer =
      engine::Trainer::Create(*config, *std::move(backend));
  Check(trainer.ok(), "the fuzz job's trainer");
  return *std::move(trainer);
}

}  // namespace

FuzzJob JobFor(const std::string& job_id) {
  if (job_id == "gpt") return FuzzJob::kGpt;
  return job_id == "ce" ? FuzzJob::kEmbedding : FuzzJob::kMlp;
}

v1::CreateJobRequest CreateRequestFor(FuzzJob job) {
  v1::CreateJobRequest request;
  v1::JobConfig& config = *request.mutable_config();
  config.set_seed(7);
  v1::ModelSpec& model = *config.mutable_model();
  if (job == FuzzJob::kMlp) {
    config.set_display_name("fuzz-mlp");
    config.set_precision(v1::PRECISION_FP16);
    *model.add_layers() = LinearLayer(kMlpIn, 16);
    model.add_layers()->mutable_gelu();
    model.add_layers()->mutable_layer_norm()->set_normalized_shape(16);
    *model.add_layers() = LinearLayer(16, kMlpOut);
    model.set_loss(v1::LOSS_MSE);
  } else if (job == FuzzJob::kGpt) {
    config.set_display_name("fuzz-gpt");
    config.set_precision(v1::PRECISION_FP16);
    v1::Gpt& gpt = *model.mutable_gpt();
    gpt.set_vocab_size(kVocab);
    gpt.set_context_length(8);
    gpt.set_d_model(8);
    gpt.set_n_layer(1);
    gpt.set_n_head(2);
  } else {
    config.set_display_name("fuzz-ce");
    config.set_precision(v1::PRECISION_BF16);
    config.mutable_scaler()->set_policy(v1::SCALER_POLICY_DEEPSPEED);
    v1::Layer embedding;
    embedding.mutable_embedding()->set_num_embeddings(kVocab);
    embedding.mutable_embedding()->set_embedding_dim(8);
    *model.add_layers() = embedding;
    *model.add_layers() = LinearLayer(8, kVocab);
    model.set_loss(v1::LOSS_CROSS_ENTROPY);
  }
  return request;
}

engine::Trainer& TrainerFor(FuzzJob job) {
  static engine::Trainer* const mlp = Build(FuzzJob::kMlp).release();
  static engine::Trainer* const embedding = Build(FuzzJob::kEmbedding).release();
  static engine::Trainer* const gpt = Build(FuzzJob::kGpt).release();
  if (job == FuzzJob::kGpt) return *gpt;
  return job == FuzzJob::kMlp ? *mlp : *embedding;
}

v1::StepRequest StepRequestFor(FuzzJob job, int rows) {
  v1::StepRequest request;
  request.set_job_id(job == FuzzJob::kMlp ? "mlp" : job == FuzzJob::kGpt ? "gpt" : "ce");
  request.set_sequence(1);
  v1::MicroBatch& batch = *request.add_micro_batches();
  if (job == FuzzJob::kGpt) {
    *batch.mutable_inputs() = SequenceTensor(rows, 0);
    *batch.mutable_targets() = SequenceTensor(rows, 1);
  } else if (job == FuzzJob::kMlp) {
    *batch.mutable_inputs() = FloatTensor({rows, kMlpIn}, -0.5f);
    *batch.mutable_targets() = FloatTensor({rows, kMlpOut}, 0.25f);
  } else {
    *batch.mutable_inputs() = IdTensor(rows, kVocab);
    *batch.mutable_targets() = IdTensor(rows, kVocab);
  }
  return request;
}

v1::StepRequest TokenLossStepFor(v1::LossFn loss_fn, int rows) {
  v1::StepRequest request = StepRequestFor(FuzzJob::kGpt, rows);
  request.set_loss_fn(loss_fn);
  v1::MicroBatch& batch = *request.mutable_micro_batches(0);
  if (loss_fn == v1::LOSS_FN_CROSS_ENTROPY) {
    *batch.mutable_weights() = FloatTensor({rows, kGptSeq}, 0.5f);
  } else {
    *batch.mutable_advantages() = FloatTensor({rows, kGptSeq}, -0.2f);
    *batch.mutable_sampling_logprobs() = FloatTensor({rows, kGptSeq}, -3.5f);
    if (loss_fn == v1::LOSS_FN_PPO) {
      request.set_ppo_clip_low(0.9f);
      request.set_ppo_clip_high(1.1f);
    }
    if (loss_fn == v1::LOSS_FN_CISPO) {
      request.set_cispo_clip_low(0.5f);
      request.set_cispo_clip_high(2.0f);
    }
    if (loss_fn == v1::LOSS_FN_DRO) request.set_dro_beta(0.1f);
  }
  return request;
}

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::abort();
}

}  // namespace ampd::fuzz
