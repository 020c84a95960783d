// RecordingBackend: a Backend that runs every op on another one (the CPU
// oracle in the tests) and records, per kind of op, the largest operands
// the model asked for, in the terms of kernels::ScratchExtents, and every
// GEMM's output and beta, and every device-to-device copy's source. A test runs a model's passes
// through it and checks that the extents the model declares (model::StepScratchExtents, which
// admission prices and a backend sizes its scratch by) cover what its ops request, on any backend:
// the CUDA backend runs the same calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace ampd::engine::testing {

class RecordingBackend final : public kernels::Backend {
 public:
  using Tensor = kernels::Tensor;
  using Shape = kernels::Shape;
  using DType = kernels::DType;
  using HostCopy = kernels::HostCopy;
  using RandomFill = kernels::RandomFill;
  using ScratchExtents = kernels::ScratchExtents;
  using AttentionOptions = kernels::AttentionOptions;
  using GemmActivation = kernels::GemmActivation;
  using BiasGradOf = kernels::BiasGradOf;
  using Activation = kernels::Activation;
  using GluActivation = kernels::GluActivation;
  using TokenLossTerms = kernels::TokenLossTerms;
  using SampleParams = kernels::SampleParams;
  using ParamRef = kernels::ParamRef;
  using AdamConfig = kernels::AdamConfig;
  using SgdConfig = kernels::SgdConfig;
  using GradTransform = kernels::GradTransform;

  // One GEMM-family call: its op, its result's memory and element count,
  // and its alpha and beta (1 for GemmBiasActivation, which has none).
  struct GemmCall {
    std::string op;
    const void* c = nullptr;
    int64_t c_elements = 0;
    float alpha = 1.0f;
    float beta = 0.0f;
  };

  // One Copy or CopyColumns: its source's memory and element count.
  struct CopyCall {
    std::string op;
    const void* src = nullptr;
    int64_t src_elements = 0;
  };

  explicit RecordingBackend(kernels::Backend& inner) : inner_(inner) {}

  // The largest operands seen since the last Clear (dtype unset).
  const ScratchExtents& seen() const { return seen_; }
  const std::vector<GemmCall>& gemms() const { return gemms_; }
  const std::vector<CopyCall>& copies() const { return copies_; }
  void Clear() {
    seen_ = ScratchExtents();
    gemms_.clear();
    copies_.clear();
  }

  using Backend::ActivationBackward;
  using Backend::ActivationForward;
  using Backend::AdamUpdate;
  using Backend::AddBias;
  using Backend::AddScaled;
  using Backend::Allocate;
  using Backend::AllocationCount;
  using Backend::AttentionBackward;
  using Backend::AttentionDecode;
  using Backend::AttentionForward;
  using Backend::BiasGrad;
  using Backend::BytesInUse;
  using Backend::Cast;
  using Backend::Copy;
  using Backend::CopyColumns;
  using Backend::CopyFromHost;
  using Backend::CopyToHost;
  using Backend::CrossEntropyChunk;
  using Backend::CrossEntropyLoss;
  using Backend::EmbeddingBackward;
  using Backend::EmbeddingForward;
  using Backend::ExpandKvHeads;
  using Backend::Fill;
  using Backend::FillRandom;
  using Backend::FillTensors;
  using Backend::GatedMulBackward;
  using Backend::GatedMulForward;
  using Backend::Gemm;
  using Backend::GemmActivationBackward;
  using Backend::GemmBiasActivation;
  using Backend::GemmBiasGrad;
  using Backend::GradLog2Histogram;
  using Backend::HeadRmsNormBackward;
  using Backend::HeadRmsNormForward;
  using Backend::LabelLogprobs;
  using Backend::LayerNormBackward;
  using Backend::LayerNormForward;
  using Backend::MemoryCapacityBytes;
  using Backend::MseLoss;
  using Backend::name;
  using Backend::native_stream;
  using Backend::ReadBack;
  using Backend::ReduceKvHeads;
  using Backend::ReleaseScratch;
  using Backend::RmsNormBackward;
  using Backend::RmsNormForward;
  using Backend::Rope;
  using Backend::SampleScratchBytes;
  using Backend::SampleTokens;
  using Backend::ScratchBytes;
  using Backend::SetBatchInvariant;
  using Backend::SgdUpdate;
  using Backend::Synchronize;
  using Backend::UnscaleAndCheck;
  using Backend::WriteKvRows;

  std::string name() const override { return inner_.name(); }
  NativeStream native_stream() override { return inner_.native_stream(); }
  absl::StatusOr<Tensor> Allocate(DType dtype, const Shape& shape) override {
    return inner_.Allocate(dtype, shape);
  }
  absl::Status CopyFromHost(const void* src, size_t bytes, Tensor& dst) override {
    return inner_.CopyFromHost(src, bytes, dst);
  }
  absl::Status CopyToHost(const Tensor& src, void* dst, size_t bytes) override {
    return inner_.CopyToHost(src, dst, bytes);
  }
  absl::Status Copy(const Tensor& src, Tensor& dst) override {
    copies_.push_back({"Copy", src.data(), src.numel()});
    return inner_.Copy(src, dst);
  }
  absl::Status CopyColumns(const Tensor& src, int64_t src_col, int64_t cols, Tensor& dst,
                           int64_t dst_col) override {
    copies_.push_back({"CopyColumns", src.data(), src.numel()});
    return inner_.CopyColumns(src, src_col, cols, dst, dst_col);
  }
  absl::Status Fill(Tensor& dst, float value) override { return inner_.Fill(dst, value); }
  absl::Status FillTensors(absl::Span<Tensor* const> dsts, float value) override {
    return inner_.FillTensors(dsts, value);
  }
  absl::Status FillRandom(Tensor& dst, const RandomFill& fill) override {
    return inner_.FillRandom(dst, fill);
  }
  absl::Status Cast(const Tensor& src, Tensor& dst) override { return inner_.Cast(src, dst); }
  absl::Status Synchronize() override { return inner_.Synchronize(); }
  absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                        absl::Span<const HostCopy> copies) override {
    return inner_.ReadBack(scalars, out, copies);
  }
  int64_t BytesInUse() const override { return inner_.BytesInUse(); }
  int64_t AllocationCount() const override { return inner_.AllocationCount(); }
  int64_t MemoryCapacityBytes() const override { return inner_.MemoryCapacityBytes(); }
  int64_t ScratchBytes(const ScratchExtents& extents, int64_t tensor_bytes) const override {
    return inner_.ScratchBytes(extents, tensor_bytes);
  }
  void ReleaseScratch() override { return inner_.ReleaseScratch(); }
  absl::Status SetBatchInvariant(bool on) override { return inner_.SetBatchInvariant(on); }
  absl::Status AddScaled(const Tensor& x, float scale, Tensor& y) override {
    return inner_.AddScaled(x, scale, y);
  }
  absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c) override {
    RecordGemm(trans_a, trans_b, alpha, a, b, beta, c);
    return inner_.Gemm(trans_a, trans_b, alpha, a, b, beta, c);
  }
  absl::Status AddBias(const Tensor& bias, Tensor& y) override { return inner_.AddBias(bias, y); }
  absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) override {
    return inner_.BiasGrad(dy, beta, dbias);
  }
  absl::Status GemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                  const Tensor* bias, GemmActivation act, Tensor& c,
                                  Tensor* pre) override {
    RecordGemmBiasActivation(trans_a, trans_b, a, b, bias, act, c, pre);
    return inner_.GemmBiasActivation(trans_a, trans_b, a, b, bias, act, c, pre);
  }
  absl::Status GemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                            float beta, Tensor& c, BiasGradOf of, Tensor& dbias) override {
    RecordGemmBiasGrad(trans_a, trans_b, a, b, beta, c, of, dbias);
    return inner_.GemmBiasGrad(trans_a, trans_b, a, b, beta, c, of, dbias);
  }
  absl::Status GemmActivationBackward(bool trans_a, bool trans_b, float alpha, const Tensor& a,
                                      const Tensor& b, GemmActivation act, const Tensor* pre,
                                      Tensor& c) override {
    RecordGemmActivationBackward(trans_a, trans_b, alpha, a, b, act, pre, c);
    return inner_.GemmActivationBackward(trans_a, trans_b, alpha, a, b, act, pre, c);
  }
  absl::Status ActivationForward(Activation act, const Tensor& x, Tensor& y) override {
    return inner_.ActivationForward(act, x, y);
  }
  absl::Status ActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                  Tensor& dx) override {
    return inner_.ActivationBackward(act, x, dy, dx);
  }
  absl::Status AttentionForward(const Tensor& qkv, int64_t n_head, const AttentionOptions& options,
                                Tensor& out, Tensor& lse) override {
    RecordAttentionForward(qkv, n_head, options, out, lse);
    return inner_.AttentionForward(qkv, n_head, options, out, lse);
  }
  absl::Status AttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                 const Tensor& lse, int64_t n_head, const AttentionOptions& options,
                                 Tensor& dqkv) override {
    RecordAttentionBackward(qkv, out, dout, lse, n_head, options, dqkv);
    return inner_.AttentionBackward(qkv, out, dout, lse, n_head, options, dqkv);
  }
  absl::Status AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& positions, int64_t heads, int64_t kv_heads,
                               const AttentionOptions& options, Tensor& out) override {
    return inner_.AttentionDecode(q, k_cache, v_cache, positions, heads, kv_heads, options, out);
  }
  absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                           const Tensor& positions, Tensor& k_cache, Tensor& v_cache) override {
    return inner_.WriteKvRows(rows, k_col, v_col, positions, k_cache, v_cache);
  }
  absl::Status ExpandKvHeads(const Tensor& src, int64_t heads, int64_t kv_heads,
                             Tensor& dst) override {
    return inner_.ExpandKvHeads(src, heads, kv_heads, dst);
  }
  absl::Status ReduceKvHeads(const Tensor& dexpanded, int64_t heads, int64_t kv_heads,
                             Tensor& dsrc) override {
    return inner_.ReduceKvHeads(dexpanded, heads, kv_heads, dsrc);
  }
  absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                                Tensor& y, Tensor& mean, Tensor& rstd) override {
    return inner_.LayerNormForward(x, gamma, beta, eps, y, mean, rstd);
  }
  absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                                 Tensor* dbeta) override {
    return inner_.LayerNormBackward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
  }
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                              Tensor& y, Tensor& rstd) override {
    return inner_.RmsNormForward(x, weight, eps, weight_offset, y, rstd);
  }
  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx,
                               Tensor* dweight) override {
    return inner_.RmsNormBackward(x, weight, weight_offset, rstd, dy, dx, dweight);
  }
  absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                  float eps, float weight_offset, Tensor& y,
                                  Tensor& rstd) override {
    return inner_.HeadRmsNormForward(x, col, heads, weight, eps, weight_offset, y, rstd);
  }
  absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                   const Tensor& weight, float weight_offset, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dx, Tensor* dweight) override {
    return inner_.HeadRmsNormBackward(x, col, heads, weight, weight_offset, rstd, dy, dx, dweight);
  }
  absl::Status Rope(Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                    const Tensor* positions, bool inverse) override {
    return inner_.Rope(x, heads, head_dim, inv_freq, positions, inverse);
  }
  absl::Status GatedMulForward(GluActivation act, const Tensor& gate, const Tensor& up,
                               Tensor& y) override {
    return inner_.GatedMulForward(act, gate, up, y);
  }
  absl::Status GatedMulBackward(GluActivation act, const Tensor& gate, const Tensor& up,
                                const Tensor& dy, Tensor& dgate, Tensor& dup) override {
    return inner_.GatedMulBackward(act, gate, up, dy, dgate, dup);
  }
  absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale,
                                Tensor& out) override {
    return inner_.EmbeddingForward(ids, table, scale, out);
  }
  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale,
                                 Tensor& dtable) override {
    return inner_.EmbeddingBackward(ids, dout, scale, dtable);
  }
  absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                       Tensor& loss, Tensor& dpred) override {
    return inner_.MseLoss(pred, target, multiplier, grad_scale, loss, dpred);
  }
  absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                                float grad_scale, Tensor& loss, Tensor& dlogits) override {
    return inner_.CrossEntropyLoss(logits, labels, multiplier, grad_scale, loss, dlogits);
  }
  absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                 const TokenLossTerms& terms, float loss_scale, float grad_scale,
                                 Tensor& loss, Tensor& dlogits) override {
    RecordCrossEntropyChunk(logits, labels, ignore_index, terms, loss_scale, grad_scale, loss,
                            dlogits);
    return inner_.CrossEntropyChunk(logits, labels, ignore_index, terms, loss_scale, grad_scale,
                                    loss, dlogits);
  }
  absl::Status LabelLogprobs(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                             float temperature, Tensor& logprobs) override {
    RecordLabelLogprobs(logits, labels, ignore_index, temperature, logprobs);
    return inner_.LabelLogprobs(logits, labels, ignore_index, temperature, logprobs);
  }
  absl::Status SampleTokens(const Tensor& logits, const Tensor& live, const SampleParams& params,
                            Tensor& tokens) override {
    return inner_.SampleTokens(logits, live, params, tokens);
  }
  int64_t SampleScratchBytes(int64_t rows, int64_t vocab) const override {
    return inner_.SampleScratchBytes(rows, vocab);
  }
  absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                               Tensor& found_inf, Tensor* norm_sq, Tensor* max_abs) override {
    return inner_.UnscaleAndCheck(grads, inv_scale, in_place, found_inf, norm_sq, max_abs);
  }
  absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config, int64_t step,
                          const GradTransform& transform) override {
    return inner_.AdamUpdate(params, config, step, transform);
  }
  absl::Status SgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                         bool first_step, const GradTransform& transform) override {
    return inner_.SgdUpdate(params, config, first_step, transform);
  }
  absl::Status GradLog2Histogram(absl::Span<const Tensor* const> grads, Tensor& counts) override {
    return inner_.GradLog2Histogram(grads, counts);
  }

 private:
  static void Max(int64_t& field, int64_t value) { field = std::max(field, value); }
  void RecordOperands(const char* op, const Tensor& a, const Tensor& b, const Tensor& c,
                      float alpha, float beta) {
    Max(seen_.gemm_a, a.numel());
    Max(seen_.gemm_b, b.numel());
    Max(seen_.gemm_c, c.numel());
    gemms_.push_back({op, c.data(), c.numel(), alpha, beta});
  }
  void RecordGemm(bool, bool, float alpha, const Tensor& a, const Tensor& b, float beta,
                  const Tensor& c) {
    RecordOperands("Gemm", a, b, c, alpha, beta);
  }
  void RecordGemmBiasActivation(bool, bool, const Tensor& a, const Tensor& b, const Tensor*,
                                GemmActivation, const Tensor& c, const Tensor*) {
    RecordOperands("GemmBiasActivation", a, b, c, 1.0f, 0.0f);
    Max(seen_.bias_activation_c, c.numel());
  }
  void RecordGemmBiasGrad(bool, bool, const Tensor& a, const Tensor& b, float beta, const Tensor& c,
                          BiasGradOf, const Tensor&) {
    RecordOperands("GemmBiasGrad", a, b, c, 1.0f, beta);
  }
  void RecordGemmActivationBackward(bool, bool, float alpha, const Tensor& a, const Tensor& b,
                                    GemmActivation, const Tensor*, const Tensor& c) {
    RecordOperands("GemmActivationBackward", a, b, c, alpha, 0.0f);
    Max(seen_.activation_backward_c, c.numel());
  }
  // qkv (B, T, 3 H D): the heads' size from the fused width.
  void RecordAttention(const Tensor& qkv, int64_t n_head) {
    if (qkv.rank() != 3 || n_head <= 0) return;
    Max(seen_.attention_seq, qkv.dim(1));
    Max(seen_.head_dim, qkv.dim(2) / (3 * n_head));
  }
  void RecordAttentionForward(const Tensor& qkv, int64_t n_head, const AttentionOptions&,
                              const Tensor&, const Tensor&) {
    RecordAttention(qkv, n_head);
  }
  void RecordAttentionBackward(const Tensor& qkv, const Tensor&, const Tensor&, const Tensor&,
                               int64_t n_head, const AttentionOptions&, const Tensor&) {
    RecordAttention(qkv, n_head);
  }
  void RecordLogits(const Tensor& logits) {
    if (logits.rank() != 2) return;
    Max(seen_.rows, logits.dim(0));
    Max(seen_.classes, logits.dim(1));
  }
  void RecordCrossEntropyChunk(const Tensor& logits, const Tensor&, int64_t, const TokenLossTerms&,
                               float, float, const Tensor&, const Tensor&) {
    RecordLogits(logits);
  }
  void RecordLabelLogprobs(const Tensor& logits, const Tensor&, int64_t, float, const Tensor&) {
    RecordLogits(logits);
  }

  kernels::Backend& inner_;
  ScratchExtents seen_;
  std::vector<GemmCall> gemms_;
  std::vector<CopyCall> copies_;
};

}  // namespace ampd::engine::testing
