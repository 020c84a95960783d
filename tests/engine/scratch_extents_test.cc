// A transformer's declared scratch extents (model::StepScratchExtents)
// against what its ops ask for, on every family part: each pass (a training
// micro-batch's forward, loss and backward, the first and a later one; an
// evaluation; a sampler's prefill and decode steps) runs through a
// RecordingBackend over the CPU oracle, and every operand it records must
// fit the extents the model declares for that shape. The extents are what
// admission prices and what a backend may size its scratch by, and the
// CUDA backend runs these same calls, so a gap here is a gap there. And a
// decode state allocates no more than the DecodeStateBytes admitted for it,
// and its decode steps copy no weight (the stacked q|k|v are its own).
//
// The families: GPT-2 (tied and untied, Conv1D layouts, the fused c_attn
// and GELU epilogues, the head in one chunk and in several), a Qwen2-style
// decoder (grouped K/V heads, biases), a LoRA decoder on every projection,
// Qwen3's per-head q/k norm with heads wider than hidden / heads, and
// Gemma 3's sandwich norms, GeGLU and a sliding layer.
#include <cstdint>
#include <memory>
#include <set>
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
using kernels::ScratchExtents;
using namespace ampd::engine::testing;

// The small decoder with q/k/v biases.
model::ModelSpec Qwen2() {
  model::ModelSpec spec = SmallDecoderSpec();
  spec.decoder()->qkv_bias = true;
  return spec;
}

model::ModelSpec LoraQwen2() {
  model::ModelSpec spec = Qwen2();
  spec.decoder()->lora = model::LoraSpec{
      4, 8.0f, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
  return spec;
}

// Heads of 16 where hidden / heads is 8: Q = 64 is twice C.
model::ModelSpec Qwen3() {
  model::ModelSpec spec = Qwen2();
  spec.decoder()->qkv_bias = false;
  spec.decoder()->qk_norm = true;
  spec.decoder()->head_dim = 16;
  return spec;
}

model::ModelSpec Gemma3() {
  model::ModelSpec spec = Qwen3();
  model::DecoderSpec& d = *spec.decoder();
  d.num_key_value_heads = 1;
  d.norm_unit_offset = true;
  d.mlp_activation = model::MlpActivation::kGeluTanh;
  d.sandwich_norms = true;
  d.scale_embeddings = true;
  d.query_pre_attn_scalar = 12.0f;
  d.tie_word_embeddings = true;
  d.sliding_layers = {true, false};
  d.sliding_window = 4;
  d.rope_local_theta = 10000.0f;
  return spec;
}

struct Case {
  std::string name;
  model::ModelSpec spec;
  model::Precision precision;
  int64_t lm_head_chunk_bytes;
};

std::vector<Case> Cases() {
  const int64_t whole = model::kLmHeadChunkBytes;
  // 5 rows of a 40-token vocabulary in 16 bits: a (2, 8) batch's head in
  // four chunks (the F32 head-gradient sum), and in fp32 chunks of 2 rows.
  const int64_t chunked = 5 * 40 * 2;
  return {
      {"gpt tied fp16", SmallGptSpec(true), model::Precision::kFp16, whole},
      {"gpt untied bf16", SmallGptSpec(false), model::Precision::kBf16, whole},
      {"gpt tied bf16 chunked head", SmallGptSpec(true), model::Precision::kBf16, chunked},
      {"gpt untied fp32 chunked head", SmallGptSpec(false), model::Precision::kFp32, chunked},
      {"qwen2 fp16", Qwen2(), model::Precision::kFp16, whole},
      {"qwen2 bf16 chunked head", Qwen2(), model::Precision::kBf16, chunked},
      {"lora qwen2 bf16", LoraQwen2(), model::Precision::kBf16, whole},
      {"lora qwen2 fp16 chunked head", LoraQwen2(), model::Precision::kFp16, chunked},
      {"qwen3 bf16", Qwen3(), model::Precision::kBf16, whole},
      {"gemma3 bf16", Gemma3(), model::Precision::kBf16, whole},
      {"gemma3 fp32", Gemma3(), model::Precision::kFp32, whole},
      // A vocabulary wider than the blocks' activations in chunks of 2 rows:
      // fewer than a sampler's 3 sequences, whose decode steps' head is one
      // (S, V) GEMM.
      {"gpt tied bf16 wide vocabulary, 2-row head chunks", SmallGptSpec(true, 2000),
       model::Precision::kBf16, 2 * 2000 * 2},
  };
}

// Every recorded operand within the declared extents, field by field.
void ExpectCovered(const ScratchExtents& seen, const ScratchExtents& declared,
                   const std::string& pass) {
  SCOPED_TRACE(pass);
  EXPECT_LE(seen.gemm_a, declared.gemm_a) << "a GEMM's first operand";
  EXPECT_LE(seen.gemm_b, declared.gemm_b) << "a GEMM's second operand";
  EXPECT_LE(seen.gemm_c, declared.gemm_c) << "a GEMM's result";
  EXPECT_LE(seen.bias_activation_c, declared.bias_activation_c) << "GemmBiasActivation's result";
  EXPECT_LE(seen.activation_backward_c, declared.activation_backward_c)
      << "GemmActivationBackward's result";
  EXPECT_LE(seen.attention_seq, declared.attention_seq) << "the attention's T";
  EXPECT_LE(seen.head_dim, declared.head_dim) << "the attention's head size";
  EXPECT_LE(seen.classes, declared.classes) << "the loss's classes";
  EXPECT_LE(seen.rows, declared.rows) << "the loss's rows";
}

class Harness : public RecordedTransformer {
 public:
  explicit Harness(const Case& c)
      : RecordedTransformer(c.spec, c.precision, 3, c.lm_head_chunk_bytes), case_(c) {}

  ScratchExtents Declared(int64_t batch, int64_t seq, bool backward) const {
    return model::TransformerScratchExtents(case_.spec, case_.precision, {batch, seq}, backward,
                                            case_.lm_head_chunk_bytes);
  }

  // A (B, T) batch of tokens with every third target ignored.
  absl::StatusOr<model::Workspace*> Load(int64_t batch, int64_t seq) {
    return LoadTokens(batch, seq, static_cast<uint64_t>(batch * 131 + seq), /*ignore_every=*/3);
  }

 private:
  Case case_;
};

TEST(ScratchExtents, TrainingPassesStayWithinTheDeclaredExtents) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Harness h(c);
    // T = 1 too: fewer rows than the blocks' weights have elements.
    for (const auto& [batch, seq] : std::vector<std::pair<int64_t, int64_t>>{{2, 8}, {1, 1}}) {
      SCOPED_TRACE(absl::StrCat("(", batch, ", ", seq, ")"));
      absl::StatusOr<model::Workspace*> ws = h.Load(batch, seq);
      ASSERT_TRUE(ws.ok()) << ws.status();
      ASSERT_TRUE(h.net().ZeroGrads().ok());
      for (const bool first : {true, false}) {
        h.recording().Clear();
        ASSERT_TRUE(h.net().Forward(**ws).ok());
        ASSERT_TRUE(h.net().Loss(**ws, 4.0f, h.loss()).ok());
        ASSERT_TRUE(h.net().Backward(**ws, first).ok());
        ExpectCovered(h.recording().seen(), h.Declared(batch, seq, /*backward=*/true),
                      first ? "first micro-batch" : "a later micro-batch");
      }
      h.recording().Clear();
      ASSERT_TRUE(h.net().Forward(**ws).ok());
      ASSERT_TRUE(h.net().EvalLoss(**ws, h.loss()).ok());
      ExpectCovered(h.recording().seen(), h.Declared(batch, seq, /*backward=*/false),
                    "an evaluation");
    }
  }
}

// A sampler's admission prices the prompts' (S, P) forward without a
// backward and the decode steps' head over S rows (Trainer::PlanSample).
TEST(ScratchExtents, SamplingStaysWithinThePrefillsAndTheDecodeStepsExtents) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Harness h(c);
    const int64_t sequences = 3;
    const int64_t prompt = 5;
    const int64_t max_len = 9;
    absl::StatusOr<model::Workspace*> ws = h.Load(sequences, prompt);
    ASSERT_TRUE(ws.ok()) << ws.status();
    h.recording().Clear();
    ASSERT_TRUE(h.net().Forward(**ws).ok());
    auto state = h.net().NewDecodeState(sequences, max_len);
    ASSERT_TRUE(state.ok()) << state.status();
    const std::vector<int64_t> lengths = {5, 3, 4};
    ASSERT_TRUE(h.net().Prefill(**ws, lengths, **state).ok());
    auto logits = h.recording().Allocate(h.net().working_dtype(),
                                         {sequences, h.net().LmHead()->value().dim(0)});
    ASSERT_TRUE(logits.ok());
    std::vector<int64_t> tokens = {1, 2, 3};
    std::vector<int64_t> positions = lengths;
    for (int64_t step = 0; step < max_len - prompt; ++step) {
      ASSERT_TRUE(
          model::LmLogits(h.recording(), (*state)->hidden, *h.net().LmHead(), *logits).ok());
      ASSERT_TRUE(h.net().DecodeStep(tokens, positions, **state).ok());
      for (int64_t& p : positions) ++p;
    }
    // What Trainer::Sample admits: the prefill's and the decode steps'.
    ScratchExtents declared = h.Declared(sequences, prompt, /*backward=*/false);
    model::WidenExtents(model::DecodeScratchExtents(c.spec, c.precision, sequences), declared);
    ExpectCovered(h.recording().seen(), declared, "prefill and decode");
  }
}

// How many of the recorded copies read a parameter's value (its master or
// working copy).
int64_t ParameterCopies(model::Network& net, const RecordingBackend& recording) {
  std::set<const void*> values;
  for (const model::Parameter& p : net.params()) {
    for (const kernels::Tensor* t : {&p.master, &p.working}) {
      if (!t->empty()) values.insert(t->data());
    }
  }
  int64_t n = 0;
  for (const RecordingBackend::CopyCall& copy : recording.copies()) {
    n += values.count(copy.src) > 0 ? 1 : 0;
  }
  return n;
}

// A decoder's separate q, k and v weights (and LoRA's q/k/v adapters) are
// stacked into its decode state's per-block stacks once, at Prefill: a
// decode step, once per generated token, copies no weight. The training
// forward still stacks them per block per pass (its weights change between
// steps), which shows the recording sees such copies.
TEST(ScratchExtents, ADecodeStepCopiesNoWeight) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Harness h(c);
    const bool stacked = c.spec.decoder() != nullptr;  // GPT-2's c_attn is fused
    const int64_t sequences = 3;
    const int64_t prompt = 5;
    absl::StatusOr<model::Workspace*> ws = h.Load(sequences, prompt);
    ASSERT_TRUE(ws.ok()) << ws.status();
    h.recording().Clear();
    ASSERT_TRUE(h.net().Forward(**ws).ok());
    EXPECT_EQ(ParameterCopies(h.net(), h.recording()) > 0, stacked) << "the training forward";
    auto state = h.net().NewDecodeState(sequences, 9);
    ASSERT_TRUE(state.ok()) << state.status();
    const std::vector<int64_t> lengths = {5, 3, 4};
    ASSERT_TRUE(h.net().Prefill(**ws, lengths, **state).ok());
    std::vector<int64_t> tokens = {1, 2, 3};
    std::vector<int64_t> positions = lengths;
    for (int64_t step = 0; step < 3; ++step) {
      h.recording().Clear();
      ASSERT_TRUE(h.net().DecodeStep(tokens, positions, **state).ok());
      EXPECT_EQ(ParameterCopies(h.net(), h.recording()), 0) << "decode step " << step;
      for (int64_t& p : positions) ++p;
    }
  }
}

// A decode step before its state's Prefill is refused: its stacked
// weights are not there yet.
TEST(ScratchExtents, ADecodeStepBeforePrefillIsRefused) {
  const Case c{"qwen2 bf16", Qwen2(), model::Precision::kBf16, model::kLmHeadChunkBytes};
  Harness h(c);
  auto state = h.net().NewDecodeState(1, 4);
  ASSERT_TRUE(state.ok()) << state.status();
  const absl::Status status = h.net().DecodeStep({1}, {0}, **state);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
}

// A sampler's decode state (its KV cache and one step's buffers) is
// admitted at DecodeStateBytes before it is allocated: what it allocates
// must not exceed that.
TEST(ScratchExtents, ADecodeStateAllocatesAtMostItsDeclaredBytes) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Harness h(c);
    for (const auto& [sequences, max_len] :
         std::vector<std::pair<int64_t, int64_t>>{{3, 9}, {1, 16}}) {
      const int64_t before = h.recording().BytesInUse();
      auto state = h.net().NewDecodeState(sequences, max_len);
      ASSERT_TRUE(state.ok()) << state.status();
      const int64_t allocated = h.recording().BytesInUse() - before;
      auto declared = h.net().DecodeStateBytes(sequences, max_len);
      ASSERT_TRUE(declared.ok()) << declared.status();
      EXPECT_LE(allocated, *declared) << sequences << " sequences of " << max_len;
      EXPECT_GT(allocated, 0);
    }
  }
}

}  // namespace
}  // namespace ampd::engine
