// The LM head's weight gradient on the update's first micro-batch: its GEMM
// writes the gradient ZeroGrads just cleared (beta = 0, no (V, C) read of
// the zeros) and a later micro-batch's adds to it (beta = 1), for a tied
// head (the embedding's gradient, which the backward adds to after) and an
// untied one, in one chunk and in several; and the gradients are the bits
// the beta = 1 form over the zeros gives. The calls are recorded by a
// Backend over the CPU oracle (recording_backend.h).
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine_test_util.h"
#include "kernels/backend_factory.h"
#include "recording_backend.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using namespace ampd::engine::testing;

model::ModelSpec Gpt(bool tied) {
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::GptSpec g;
  g.vocab_size = 40;
  g.context_length = 16;
  g.d_model = 32;
  g.n_layer = 2;
  g.n_head = 4;
  g.tie_embeddings = tied;
  spec.kind = g;
  return spec;
}

// An untied Qwen2-style decoder: Linear layouts, grouped K/V heads.
model::ModelSpec Decoder() {
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

struct Case {
  std::string name;
  model::ModelSpec spec;
  model::Precision precision;
  int64_t lm_head_chunk_bytes;
};

// 5 rows of the 40-token vocabulary in 16 bits: the (2, 8) batches' head
// in four chunks.
constexpr int64_t kChunked = 5 * 40 * 2;

std::vector<Case> Cases() {
  const int64_t whole = model::kLmHeadChunkBytes;
  return {
      {"gpt tied bf16", Gpt(true), model::Precision::kBf16, whole},
      {"gpt untied fp16", Gpt(false), model::Precision::kFp16, whole},
      {"gpt tied fp32", Gpt(true), model::Precision::kFp32, whole},
      {"gpt untied fp32 chunked", Gpt(false), model::Precision::kFp32, kChunked},
      {"gpt tied bf16 chunked", Gpt(true), model::Precision::kBf16, kChunked},
      {"decoder bf16", Decoder(), model::Precision::kBf16, whole},
  };
}

class Net {
 public:
  explicit Net(const Case& c) {
    auto cpu = kernels::CreateBackend("cpu");
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
    recording_ = std::make_unique<RecordingBackend>(*cpu_);
    auto net = model::TransformerModel::Create(c.spec, c.precision, 11, *recording_,
                                               c.lm_head_chunk_bytes);
    EXPECT_TRUE(net.ok()) << net.status();
    net_ = *std::move(net);
    auto loss = recording_->Allocate(DType::kF32, {1, 1});
    EXPECT_TRUE(loss.ok());
    loss_ = *std::move(loss);
  }
  RecordingBackend& recording() { return *recording_; }
  model::Network& net() { return *net_; }

  // One micro-batch (seed picks its tokens): forward, loss with the head's
  // gradient written (head_writes) or added to, backward.
  absl::Status MicroBatch(uint64_t seed, bool first, bool head_writes) {
    const int64_t batch = 2, seq = 8;
    DataRng rng(seed);
    std::vector<int32_t> ids, targets;
    for (int64_t i = 0; i < batch * seq; ++i) {
      ids.push_back(rng.Index(40));
      targets.push_back(i % 4 == 3 ? -100 : rng.Index(40));
    }
    absl::StatusOr<model::Workspace*> ws = net_->GetWorkspace({batch, seq});
    if (!ws.ok()) return ws.status();
    absl::Status s = net_->LoadBatch(I32({batch, seq}, ids), I32({batch, seq}, targets), **ws);
    if (s.ok()) s = net_->Forward(**ws);
    if (s.ok()) s = net_->Loss(**ws, 8.0f, head_writes, loss_);
    if (s.ok()) s = net_->Backward(**ws, first);
    return s;
  }

  // Every gradient's bytes, by name.
  std::map<std::string, std::vector<uint8_t>> Grads() {
    std::map<std::string, std::vector<uint8_t>> grads;
    for (const model::Parameter& p : net_->params()) {
      std::vector<uint8_t> bytes(p.grad.nbytes());
      EXPECT_TRUE(recording_->CopyToHost(p.grad, bytes.data(), bytes.size()).ok());
      grads[p.name] = std::move(bytes);
    }
    return grads;
  }

 private:
  std::unique_ptr<kernels::Backend> cpu_;
  std::unique_ptr<RecordingBackend> recording_;
  std::unique_ptr<model::Network> net_;
  kernels::Tensor loss_;
};

// The betas of the GEMMs whose result is the head's gradient.
std::vector<float> HeadGradBetas(RecordingBackend& recording, const model::Network& net) {
  const kernels::Tensor& grad = net.LmHead()->grad;
  std::vector<float> betas;
  for (const RecordingBackend::GemmCall& call : recording.gemms()) {
    if (call.c == grad.data() && call.c_elements == grad.numel()) betas.push_back(call.beta);
  }
  return betas;
}

TEST(LmHeadGrad, TheFirstMicroBatchWritesTheHeadsGradientAndLaterOnesAddToIt) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Net n(c);
    ASSERT_TRUE(n.net().ZeroGrads().ok());
    n.recording().Clear();
    ASSERT_TRUE(n.MicroBatch(1, /*first=*/true, /*head_writes=*/true).ok());
    const std::vector<float> first = HeadGradBetas(n.recording(), n.net());
    n.recording().Clear();
    ASSERT_TRUE(n.MicroBatch(2, /*first=*/false, /*head_writes=*/false).ok());
    const std::vector<float> later = HeadGradBetas(n.recording(), n.net());
    const bool summed = c.lm_head_chunk_bytes == kChunked && c.precision != model::Precision::kFp32;
    if (summed) {
      // Several 16-bit chunks sum in F32 (its first GEMM already writes),
      // then one Add: no GEMM into the gradient itself.
      EXPECT_TRUE(first.empty());
      EXPECT_TRUE(later.empty());
      continue;
    }
    // One GEMM per chunk into the gradient: on the first micro-batch the
    // first writes and the rest add; on a later one all add.
    ASSERT_FALSE(first.empty());
    ASSERT_EQ(first.size(), later.size());
    EXPECT_EQ(first[0], 0.0f) << "the first GEMM into the just-zeroed gradient reads it";
    for (size_t i = 1; i < first.size(); ++i) EXPECT_EQ(first[i], 1.0f) << "chunk " << i;
    for (size_t i = 0; i < later.size(); ++i) EXPECT_EQ(later[i], 1.0f) << "chunk " << i;
  }
}

TEST(LmHeadGrad, WritingTheFirstMicroBatchsHeadGradientGivesTheBitsAddingToZerosGives) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Net written(c);
    Net added(c);
    for (Net* n : {&written, &added}) {
      ASSERT_TRUE(n->net().ZeroGrads().ok());
      ASSERT_TRUE(n->MicroBatch(1, /*first=*/true, /*head_writes=*/n == &written).ok());
      ASSERT_TRUE(n->MicroBatch(2, /*first=*/false, /*head_writes=*/false).ok());
    }
    const auto a = written.Grads();
    const auto b = added.Grads();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, bytes] : a) {
      EXPECT_TRUE(bytes == b.at(name)) << name << " differs in its bits";
    }
  }
}

}  // namespace
}  // namespace ampd::engine
