// Helpers shared by the engine tests: host tensors, a deterministic data
// generator (its own uniform draw, so data are identical everywhere), job
// configs and a Trainer on the CPU backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "server/engine/config/job_config.h"
#include "server/engine/host_tensor.h"
#include "server/engine/model/network.h"
#include "server/engine/trainer/trainer.h"

namespace ampd::engine::testing {

inline HostTensor F32(kernels::Shape shape, const std::vector<float>& values) {
  HostTensor t;
  t.dtype = kernels::DType::kF32;
  t.shape = std::move(shape);
  t.data.resize(values.size() * sizeof(float));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

inline HostTensor I32(kernels::Shape shape, const std::vector<int32_t>& values) {
  HostTensor t;
  t.dtype = kernels::DType::kI32;
  t.shape = std::move(shape);
  t.data.resize(values.size() * sizeof(int32_t));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

inline std::vector<float> ToFloats(const HostTensor& t) {
  std::vector<float> v(t.data.size() / sizeof(float));
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

class DataRng {
 public:
  explicit DataRng(uint64_t seed) : engine_(seed) {}
  float Uniform(float lo, float hi) {
    const double u = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    return static_cast<float>(lo + (hi - lo) * u);
  }
  std::vector<float> UniformVector(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (float& x : v) x = Uniform(lo, hi);
    return v;
  }
  int32_t Index(int32_t limit) {
    return static_cast<int32_t>(engine_() % static_cast<uint64_t>(limit));
  }

 private:
  std::mt19937_64 engine_;
};

inline model::LayerSpec Linear(int64_t in, int64_t out, bool bias = true) {
  model::LayerSpec l;
  l.kind = model::LayerKind::kLinear;
  l.in_features = in;
  l.out_features = out;
  l.bias = bias;
  return l;
}

inline model::LayerSpec Act(model::LayerKind kind) {
  model::LayerSpec l;
  l.kind = kind;
  return l;
}

inline model::LayerSpec LayerNorm(int64_t c, bool affine = true) {
  model::LayerSpec l;
  l.kind = model::LayerKind::kLayerNorm;
  l.normalized_shape = c;
  l.elementwise_affine = affine;
  return l;
}

inline model::LayerSpec Embedding(int64_t v, int64_t c) {
  model::LayerSpec l;
  l.kind = model::LayerKind::kEmbedding;
  l.num_embeddings = v;
  l.embedding_dim = c;
  return l;
}

// A small GPT-2 (vocab 40 unless given, context 16, 32 wide, 2 layers of 4
// heads) with the cross-entropy loss.
inline model::ModelSpec SmallGptSpec(bool tied, int64_t vocab = 40) {
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::GptSpec g;
  g.vocab_size = vocab;
  g.context_length = 16;
  g.d_model = 32;
  g.n_layer = 2;
  g.n_head = 4;
  g.tie_embeddings = tied;
  spec.kind = g;
  return spec;
}

// A small untied Llama/Qwen2-style decoder of the same size: Linear layouts,
// 4 query heads over 2 K/V heads, intermediate 48, no biases.
inline model::ModelSpec SmallDecoderSpec() {
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::DecoderSpec d;
  d.vocab_size = 40;
  d.hidden_size = 32;
  d.intermediate_size = 48;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = 2;
  d.max_position_embeddings = 16;
  spec.kind = d;
  return spec;
}

inline std::unique_ptr<Trainer> MakeTrainer(const JobConfig& config,
                                            const std::string& device = "cpu") {
  auto backend = kernels::CreateBackend(device);
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto trainer = Trainer::Create(config, *std::move(backend));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  return trainer.ok() ? *std::move(trainer) : nullptr;
}

// Bitwise equality of two state dicts (tensor names, dtypes, shapes, bytes
// and every metadata entry); returns the first difference, or "".
inline std::string StateDiff(const checkpoint::StateDict& a, const checkpoint::StateDict& b,
                             bool compare_metadata = true) {
  if (a.tensors.size() != b.tensors.size()) return "tensor count";
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    if (x.name != y.name) return "name " + x.name + " vs " + y.name;
    if (x.tensor.dtype != y.tensor.dtype || x.tensor.shape != y.tensor.shape ||
        x.tensor.data != y.tensor.data) {
      return "tensor " + x.name;
    }
  }
  if (compare_metadata && a.metadata != b.metadata) return "metadata";
  return "";
}

// Backward (first micro-batch) with a GradsReady that copies each reported
// parameter's gradient when it is reported: every parameter must be
// reported exactly once, and what was reported must be its final gradient
// (backward never writes it again), which is what lets a distributed step
// start summing it then.
inline void ExpectGradsReadyOnceAndFinal(kernels::Backend& b, model::Network& net,
                                         model::Workspace& ws) {
  std::vector<int> reports(net.params().size(), 0);
  std::vector<std::vector<char>> at_report(net.params().size());
  model::Network::BackwardHooks hooks;
  hooks.grads_ready = [&](absl::Span<const int> params) {
    for (const int p : params) {
      EXPECT_GE(p, 0);
      EXPECT_LT(static_cast<size_t>(p), reports.size());
      ++reports[static_cast<size_t>(p)];
      const kernels::Tensor& g = net.params()[static_cast<size_t>(p)].grad;
      at_report[static_cast<size_t>(p)].resize(g.nbytes());
      EXPECT_TRUE(b.CopyToHost(g, at_report[static_cast<size_t>(p)].data(), g.nbytes()).ok());
    }
    return absl::OkStatus();
  };
  ASSERT_TRUE(net.Backward(ws, /*first_micro_batch=*/true, hooks).ok());
  for (size_t p = 0; p < reports.size(); ++p) {
    const model::Parameter& param = net.params()[p];
    EXPECT_EQ(reports[p], 1) << param.name;
    std::vector<char> final_bytes(param.grad.nbytes());
    ASSERT_TRUE(b.CopyToHost(param.grad, final_bytes.data(), final_bytes.size()).ok());
    EXPECT_TRUE(final_bytes == at_report[p]) << param.name << " was written after it was reported";
  }
}

}  // namespace ampd::engine::testing
