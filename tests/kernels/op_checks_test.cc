// kernels/op_checks: the argument rules every backend shares. The CPU op
// tests cover each op's refusals through the backend; these pin the rules
// that were reconciled when the CPU and CUDA backends stopped keeping their
// own copies (exact messages, null host pointers, oversized shapes), so a
// backend that drifts from them shows up here without a GPU.
#include "kernels/op_checks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

class OpChecksTest : public ::testing::Test {
 protected:
  Tensor Make(DType dtype, const Shape& shape) { return *be_->Allocate(dtype, shape); }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
};

void ExpectMessage(const absl::Status& s, const std::string& want) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(std::string(s.message()), want);
}

TEST_F(OpChecksTest, AllocateRefusesNegativeAndOverflowingShapes) {
  EXPECT_TRUE(ValidateAllocate({}).ok());
  EXPECT_TRUE(ValidateAllocate({0, int64_t{1} << 62}).ok());  // no elements, no bytes
  ExpectMessage(ValidateAllocate({2, -1}), "Allocate: shape (2, -1) has a negative dimension");
  ExpectMessage(ValidateAllocate({int64_t{1} << 30, int64_t{1} << 30}),
                "Allocate: shape (1073741824, 1073741824) is too large");
}

TEST_F(OpChecksTest, HostCopiesRefuseANullHostPointerOnlyWhenThereAreBytes) {
  Tensor t = Make(DType::kF32, {2});
  float host[2] = {0, 0};
  EXPECT_TRUE(ValidateCopyFromHost(host, 8, t).ok());
  ExpectMessage(ValidateCopyFromHost(nullptr, 8, t), "CopyFromHost: src is null");
  ExpectMessage(ValidateCopyToHost(t, nullptr, 8), "CopyToHost: dst is null");
  Tensor none = Make(DType::kF32, {0});
  EXPECT_TRUE(ValidateCopyFromHost(nullptr, 0, none).ok());
  EXPECT_TRUE(ValidateCopyToHost(none, nullptr, 0).ok());
  // The byte count is checked first: it names both sizes.
  ExpectMessage(ValidateCopyFromHost(nullptr, 4, t),
                "CopyFromHost: dst is F32(2) (8 bytes) but 4 bytes were given");
  // Through the CPU backend too: refused, not a memcpy from null.
  ExpectMessage(be_->CopyFromHost(nullptr, 8, t), "CopyFromHost: src is null");
}

// Gemma 3's parts: a window and scale, an RMSNorm offset, a gate
// activation; refused through the CPU backend before anything is written.
TEST_F(OpChecksTest, AttentionOptionsNormOffsetAndGateActivationAreChecked) {
  AttentionOptions options;
  EXPECT_TRUE(ValidateAttentionOptions(options, "AttentionForward").ok());
  options.window = -1;
  ExpectMessage(ValidateAttentionOptions(options, "AttentionForward"),
                "AttentionForward: window is -1; expected 0 (none) or 1 .. 2^31 - 1 keys");
  options.window = 4;
  options.scale = 0.0f;
  ExpectMessage(ValidateAttentionOptions(options, "AttentionDecode"),
                "AttentionDecode: scale is 0; expected finite and > 0");
  Tensor qkv = Make(DType::kF32, {1, 4, 12});
  Tensor out = Make(DType::kF32, {1, 4, 4});
  Tensor lse = Make(DType::kF32, {1, 2, 4});
  EXPECT_EQ(be_->AttentionForward(qkv, 2, options, out, lse).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectMessage(ValidateRmsNormOffset(INFINITY, "RmsNormForward"),
                "RmsNormForward: weight_offset is inf; expected finite");
  ExpectMessage(ValidateGluActivation(static_cast<GluActivation>(7), "GatedMulForward"),
                "GatedMulForward: unknown gate activation 7");
  Tensor g = Make(DType::kF32, {3});
  EXPECT_EQ(be_->GatedMulForward(static_cast<GluActivation>(7), g, g, g).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(OpChecksTest, CopyChecksDTypeAndCountBeforeMemory) {
  Tensor src = Make(DType::kF32, {3});
  Tensor empty;  // F32 scalar shape with no memory
  Tensor half = Make(DType::kF16, {3});
  ExpectMessage(ValidateCopy(src, half), "Copy: dst is F16(3) but src is F32(3); dtypes differ");
  ExpectMessage(ValidateCopy(src, empty),
                "Copy: dst is F32() but src is F32(3); element counts differ");
  Tensor one = Make(DType::kF32, {1});
  ExpectMessage(ValidateCopy(one, empty), "Copy: dst is F32() but holds no memory");
}

TEST_F(OpChecksTest, CopyColumnsNamesTheColumnAndItsBounds) {
  Tensor src = Make(DType::kBF16, {4, 6});
  Tensor dst = Make(DType::kBF16, {4, 9});
  EXPECT_TRUE(ValidateCopyColumns(src, 6, 0, dst, 9).ok());  // an empty block at the end
  ExpectMessage(ValidateCopyColumns(src, 2, 5, dst, 0),
                "CopyColumns: src_col is 2 with cols 5 but src is BF16(4, 6); expected 0 <= "
                "src_col and src_col + cols <= 6");
  ExpectMessage(ValidateCopyColumns(src, 0, 6, dst, -1),
                "CopyColumns: dst_col is -1 with cols 6 but dst is BF16(4, 9); expected 0 <= "
                "dst_col and dst_col + cols <= 9");
  ExpectMessage(ValidateCopyColumns(src, 0, -2, dst, 0), "CopyColumns: cols is -2; expected >= 0");
  Tensor tall = Make(DType::kBF16, {5, 9});
  ExpectMessage(ValidateCopyColumns(src, 0, 1, tall, 0),
                "CopyColumns: dst is BF16(5, 9) but src is BF16(4, 6); row counts differ");
  ExpectMessage(ValidateCopyColumns(src, 0, 1, src, 2),
                "CopyColumns: dst BF16(4, 6) overlaps src BF16(4, 6)");
}

TEST_F(OpChecksTest, RmsNormBackwardTakesANullDweight) {
  Tensor x = Make(DType::kF16, {3, 8});
  Tensor w = Make(DType::kF16, {8});
  Tensor rstd = Make(DType::kF32, {3});
  Tensor dw_bad = Make(DType::kF32, {7});
  EXPECT_TRUE(ValidateRmsNormBackward(x, w, rstd, x, x, nullptr).ok());
  ExpectMessage(ValidateRmsNormBackward(x, w, rstd, x, x, &dw_bad),
                "RmsNormBackward: dweight is F32(7) but x is F16(3, 8); expected (8)");
}

TEST_F(OpChecksTest, BiasLengthAndActivationMessagesAreTheOraclesOnes) {
  Tensor y = Make(DType::kF32, {4, 3});
  Tensor bias = Make(DType::kF32, {2});
  ExpectMessage(ValidateAddBias(bias, y),
                "AddBias: bias is F32(2) but y is F32(4, 3); bias length must equal y's columns");
  ExpectMessage(ValidateBiasGrad(y, bias),
                "BiasGrad: dbias is F32(2) but dy is F32(4, 3); dbias length must equal dy's "
                "columns");
  ExpectMessage(ValidateActivationForward(static_cast<Activation>(7), y, y),
                "ActivationForward: unknown activation 7");
}

TEST_F(OpChecksTest, LinearOpsNameTheOperandAndRefuseOverlaps) {
  constexpr GemmActivation kGelu = GemmActivation::kGELUTanh;
  constexpr GemmActivation kNone = GemmActivation::kNone;
  Tensor x = Make(DType::kBF16, {4, 3});    // (M, K)
  Tensor w = Make(DType::kBF16, {3, 8});    // (K, N)
  Tensor bias = Make(DType::kBF16, {8});    // (N)
  Tensor y = Make(DType::kBF16, {4, 8});    // (M, N)
  Tensor pre = Make(DType::kBF16, {4, 8});  // (M, N)
  EXPECT_TRUE(ValidateGemmBiasActivation(false, false, x, w, &bias, kGelu, y, &pre).ok());
  EXPECT_TRUE(ValidateGemmBiasActivation(false, false, x, w, nullptr, kNone, y, nullptr).ok());
  // Gemm's rules, under the op's name.
  ExpectMessage(ValidateGemmBiasActivation(true, false, x, w, &bias, kNone, y, nullptr),
                "GemmBiasActivation: b is BF16(3, 8) but a is BF16(4, 3) (transposed); inner "
                "dims differ (4 vs 3)");
  // One dtype for every float operand: no F32 output here, unlike Gemm.
  Tensor y32 = Make(DType::kF32, {4, 8});
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &bias, kNone, y32, nullptr),
                "GemmBiasActivation: c is F32(4, 8) but a is BF16(4, 3); dtypes differ");
  Tensor short_bias = Make(DType::kBF16, {7});
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &short_bias, kNone, y, nullptr),
                "GemmBiasActivation: bias is BF16(7) but c is BF16(4, 8); bias length must "
                "equal c's columns");
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &bias, kGelu, y, nullptr),
                "GemmBiasActivation: pre is null but act is gelu_tanh; expected BF16(4, 8)");
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &bias, kNone, y, &pre),
                "GemmBiasActivation: pre is BF16(4, 8) but act is none; expected nullptr");
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &bias,
                                           static_cast<GemmActivation>(9), y, &pre),
                "GemmBiasActivation: unknown activation 9");
  ExpectMessage(ValidateGemmBiasActivation(false, false, x, w, &bias, kGelu, y, &y),
                "GemmBiasActivation: pre BF16(4, 8) overlaps c BF16(4, 8)");

  // GemmBiasGrad: the dy operand must be stored (K, width).
  Tensor dy = Make(DType::kBF16, {4, 8});  // (K, N): tokens by features
  Tensor xs = Make(DType::kBF16, {4, 3});  // (K, M)
  Tensor dw = Make(DType::kBF16, {3, 8});  // (M, N)
  Tensor db = Make(DType::kF32, {8});      // (N), any float dtype
  EXPECT_TRUE(ValidateGemmBiasGrad(true, false, xs, dy, dw, BiasGradOf::kB, db).ok());
  Tensor dw_t = Make(DType::kBF16, {8, 3});  // (N, M): dW = dy^T x
  EXPECT_TRUE(ValidateGemmBiasGrad(true, false, dy, xs, dw_t, BiasGradOf::kA, db).ok());
  Tensor dyt = Make(DType::kBF16, {8, 4});
  ExpectMessage(ValidateGemmBiasGrad(true, true, xs, dyt, dw, BiasGradOf::kB, db),
                "GemmBiasGrad: the bias gradient of b needs b stored (K, N), i.e. trans_b "
                "false; got BF16(8, 4) (transposed)");
  Tensor db3 = Make(DType::kF32, {3});
  ExpectMessage(ValidateGemmBiasGrad(true, false, xs, dy, dw, BiasGradOf::kB, db3),
                "GemmBiasGrad: dbias is F32(3) but b is BF16(4, 8); dbias length must equal its "
                "columns (8)");

  // GemmActivationBackward: pre beside c, c overlapping no input.
  Tensor dx = Make(DType::kBF16, {4, 3});
  Tensor pre_x = Make(DType::kBF16, {4, 3});
  EXPECT_TRUE(ValidateGemmActivationBackward(false, true, dy, w, kGelu, &pre_x, dx).ok());
  Tensor pre_bad = Make(DType::kBF16, {3, 4});
  ExpectMessage(ValidateGemmActivationBackward(false, true, dy, w, kGelu, &pre_bad, dx),
                "GemmActivationBackward: pre is BF16(3, 4) but c is BF16(4, 3); shapes differ");
  ExpectMessage(ValidateGemmActivationBackward(false, true, dy, w, kGelu, &dx, dx),
                "GemmActivationBackward: c BF16(4, 3) overlaps pre BF16(4, 3)");
}

TEST_F(OpChecksTest, LayerNormStatisticsMustBeOnePerRow) {
  Tensor x = Make(DType::kF32, {2, 4});
  Tensor y = Make(DType::kF32, {2, 4});
  Tensor stat = Make(DType::kF32, {2});
  Tensor stat_2d = Make(DType::kF32, {2, 1});  // two elements, but not (N)
  EXPECT_TRUE(ValidateLayerNormForward(x, nullptr, nullptr, y, stat, stat).ok());
  ExpectMessage(ValidateLayerNormForward(x, nullptr, nullptr, y, stat_2d, stat),
                "LayerNormForward: mean is F32(2, 1) but x is F32(2, 4); expected (2)");
  Tensor gamma = Make(DType::kF32, {3});
  ExpectMessage(ValidateLayerNormForward(x, &gamma, nullptr, y, stat, stat),
                "LayerNormForward: gamma is F32(3) but x is F32(2, 4); expected (4)");
}

TEST_F(OpChecksTest, EmbeddingAndLabelShapesNameEveryOperand) {
  Tensor ids = Make(DType::kI64, {3});
  Tensor table = Make(DType::kF32, {10, 4});
  Tensor out = Make(DType::kF32, {2, 4});
  ExpectMessage(ValidateEmbeddingForward(ids, table, out),
                "EmbeddingForward: out is F32(2, 4) but ids is I64(3) and table is F32(10, 4); "
                "expected (3, 4)");
  Tensor logits = Make(DType::kF32, {2, 5});
  Tensor loss = Make(DType::kF32, {1});
  ExpectMessage(ValidateCrossEntropyLoss(logits, ids, loss, logits),
                "CrossEntropyLoss: labels is I64(3) but logits is F32(2, 5); expected (2)");
}

TEST_F(OpChecksTest, AttentionAndChunkedLossMessagesNameTheOperand) {
  Tensor qkv = Make(DType::kF16, {2, 4, 24});
  Tensor out = Make(DType::kF16, {2, 4, 8});
  Tensor lse = Make(DType::kF32, {2, 2, 4});
  EXPECT_TRUE(ValidateAttentionForward(qkv, 2, out, lse).ok());
  ExpectMessage(ValidateAttentionForward(qkv, 3, out, lse),
                "AttentionForward: n_head is 3 but qkv is F16(2, 4, 24) (C = 8); n_head must "
                "divide C");
  ExpectMessage(ValidateAttentionForward(qkv, 4, out, lse),
                "AttentionForward: lse is F32(2, 2, 4); expected (B, n_head, T) = (2, 4, 4)");
  Tensor qkv_odd = Make(DType::kF16, {2, 4, 20});
  ExpectMessage(ValidateAttentionForward(qkv_odd, 2, out, lse),
                "AttentionForward: qkv is F16(2, 4, 20); expected (B, T, 3 * C) with C >= 1");
  Tensor lse_half = Make(DType::kF16, {2, 2, 4});
  ExpectMessage(ValidateAttentionForward(qkv, 2, out, lse_half),
                "AttentionForward: lse is F16(2, 2, 4); expected F32");
  Tensor dqkv = Make(DType::kF16, {2, 4, 24});
  EXPECT_TRUE(ValidateAttentionBackward(qkv, out, out, lse, 2, dqkv).ok());
  ExpectMessage(ValidateAttentionBackward(qkv, out, out, lse, 2, qkv),
                "AttentionBackward: dqkv F16(2, 4, 24) overlaps qkv F16(2, 4, 24)");
  Tensor logits = Make(DType::kBF16, {3, 7});
  Tensor labels = Make(DType::kI32, {3});
  Tensor loss = Make(DType::kF32, {1});
  EXPECT_TRUE(ValidateCrossEntropyChunk(logits, labels, {}, loss, logits).ok());  // in place
  Tensor empty_chunk = Make(DType::kBF16, {0, 7});
  Tensor no_labels = Make(DType::kI32, {0});
  EXPECT_TRUE(ValidateCrossEntropyChunk(empty_chunk, no_labels, {}, loss, empty_chunk).ok());
  ExpectMessage(ValidateCrossEntropyChunk(logits, no_labels, {}, loss, logits),
                "CrossEntropyChunk: labels is I32(0) but logits is BF16(3, 7); expected (3)");
}

TEST_F(OpChecksTest, OptimizerChecksTheTransformThenEachParam) {
  Tensor master = Make(DType::kF32, {4});
  Tensor grad = Make(DType::kF16, {4});
  Tensor m = Make(DType::kF32, {4});
  Tensor found_inf = Make(DType::kF32, {1});
  GradTransform tr;
  tr.found_inf = &found_inf;
  const ParamRef no_state{&master, nullptr, &grad, nullptr, nullptr};
  const ParamRef with_m{&master, nullptr, &grad, &m, nullptr};
  // Plain SGD needs no state; momentum needs state0; Adam needs both.
  EXPECT_TRUE(ValidateSgdUpdate({&no_state, 1}, SgdConfig{}, tr).ok());
  SgdConfig momentum;
  momentum.momentum = 0.9f;
  ExpectMessage(ValidateSgdUpdate({&no_state, 1}, momentum, tr),
                "SgdUpdate: params[0].state0 is null");
  EXPECT_TRUE(ValidateSgdUpdate({&with_m, 1}, momentum, tr).ok());
  ExpectMessage(ValidateAdamUpdate({&with_m, 1}, 1, tr), "AdamUpdate: params[0].state1 is null");
  ExpectMessage(ValidateAdamUpdate({&with_m, 1}, 0, tr), "AdamUpdate: step is 0; expected >= 1");
  GradTransform missing;
  ExpectMessage(ValidateOptimizerParams("SgdUpdate", {&no_state, 1}, false, false, missing),
                "SgdUpdate: transform.found_inf is null");
}

}  // namespace
}  // namespace ampd::kernels
