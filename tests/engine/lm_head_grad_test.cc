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
#include "recorded_transformer.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using namespace ampd::engine::testing;

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
      {"gpt tied bf16", SmallGptSpec(true), model::Precision::kBf16, whole},
      {"gpt untied fp16", SmallGptSpec(false), model::Precision::kFp16, whole},
      {"gpt tied fp32", SmallGptSpec(true), model::Precision::kFp32, whole},
      {"gpt untied fp32 chunked", SmallGptSpec(false), model::Precision::kFp32, kChunked},
      {"gpt tied bf16 chunked", SmallGptSpec(true), model::Precision::kBf16, kChunked},
      {"decoder bf16", SmallDecoderSpec(), model::Precision::kBf16, whole},
  };
}

class Net : public RecordedTransformer {
 public:
  explicit Net(const Case& c)
      : RecordedTransformer(c.spec, c.precision, 11, c.lm_head_chunk_bytes) {}

  // One micro-batch (seed picks its tokens): forward, loss with the head's
  // gradient written (head_writes) or added to, backward.
  absl::Status MicroBatch(uint64_t seed, bool first, bool head_writes) {
    absl::StatusOr<model::Workspace*> ws = LoadTokens(2, 8, seed, /*ignore_every=*/4);
    if (!ws.ok()) return ws.status();
    absl::Status s = net().Forward(**ws);
    if (s.ok()) s = net().Loss(**ws, 8.0f, head_writes, loss());
    if (s.ok()) s = net().Backward(**ws, first);
    return s;
  }

  // Every gradient's bytes, by name.
  std::map<std::string, std::vector<uint8_t>> Grads() {
    std::map<std::string, std::vector<uint8_t>> grads;
    for (const model::Parameter& p : net().params()) {
      std::vector<uint8_t> bytes(p.grad.nbytes());
      EXPECT_TRUE(recording().CopyToHost(p.grad, bytes.data(), bytes.size()).ok());
      grads[p.name] = std::move(bytes);
    }
    return grads;
  }
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
