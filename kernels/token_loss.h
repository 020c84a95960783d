// The per-token losses a language model's step may train on, as Tinker
// defines them (sums over tokens, never means), and the one function that
// turns a token's log-prob into its loss term and its gradient coefficient.
// Plain C++ for the host and nvcc both, so the CPU oracle
// (kernels/cpu/cross_entropy_chunk.cc) and the CUDA row engine
// (kernels/cuda/cross_entropy_rows.cuh) compute the same formula.
//
// With logp the log-softmax of a token's label, a its advantage, q its
// log-prob under the sampler and r = exp(logp - q):
//   kCrossEntropy:       term = -w * logp                       (w: weight, 1 without)
//   kImportanceSampling: term = -r * a
//   kPpo:                term = -min(r * a, clip(r, clip_low, clip_high) * a)
//   kCispo:              term = -(sg(clip(r, clip_low, clip_high)) * logp * a)
//   kDro:                term = -(logp * a - 0.5 * beta * (logp - q)^2)
// (sg: stop-gradient, Tinker's .detach()). The gradient of a term with
// respect to the row's logits is coef * (softmax - onehot(label)) with
// coef = -d term / d logp:
//   kCrossEntropy: w; kImportanceSampling: r * a; kPpo: r * a * g, where g
// is PyTorch's autograd of that expression: 1 where the unclipped product
// is the smaller, [clip_low <= r <= clip_high] (clamp's gradient) where the
// clipped one is, and the mean of the two where they tie (torch.minimum
// splits a tie's gradient evenly); kCispo: clip(r, clip_low, clip_high) * a
// (the clipped ratio is a constant: every kept token keeps a gradient);
// kDro: a - beta * (logp - q).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define AMPD_TOKEN_LOSS_HD __host__ __device__
#else
#define AMPD_TOKEN_LOSS_HD
#endif

namespace ampd::kernels {

enum class TokenLossKind : uint8_t { kCrossEntropy, kImportanceSampling, kPpo, kCispo, kDro };

// Whether a kind reads advantages and sampling_logprobs (all but
// kCrossEntropy, which reads weights instead).
AMPD_TOKEN_LOSS_HD inline bool ReadsSamplingLogprobs(TokenLossKind kind) {
  return kind != TokenLossKind::kCrossEntropy;
}

// One token's loss term and its gradient coefficient.
struct TokenTerm {
  float term;
  float coef;
};

// logp: the token's log-prob (fp32); weight, advantage, sampling_logprob:
// its inputs; clip_low, clip_high (kPpo, kCispo) and beta (kDro): the
// kind's parameters (what a kind does not read is ignored). Each term is
// evaluated in the order Tinker's PyTorch expression is, in fp32.
AMPD_TOKEN_LOSS_HD inline TokenTerm TokenLossTerm(TokenLossKind kind, float logp, float weight,
                                                  float advantage, float sampling_logprob,
                                                  float clip_low, float clip_high, float beta) {
  if (kind == TokenLossKind::kCrossEntropy) return {-(weight * logp), weight};
  if (kind == TokenLossKind::kDro) {
    const float delta = logp - sampling_logprob;
    const float half_beta = 0.5f * beta;
    return {-(logp * advantage - half_beta * (delta * delta)), advantage - beta * delta};
  }
  const float ratio = expf(logp - sampling_logprob);
  const float unclipped = ratio * advantage;
  if (kind == TokenLossKind::kImportanceSampling) return {-unclipped, unclipped};
  const float clipped_ratio = fminf(fmaxf(ratio, clip_low), clip_high);
  if (kind == TokenLossKind::kCispo) {
    return {-(clipped_ratio * logp * advantage), clipped_ratio * advantage};
  }
  const float clipped = clipped_ratio * advantage;
  const float inside = ratio >= clip_low && ratio <= clip_high ? 1.0f : 0.0f;
  float g = 0.0f;
  if (unclipped < clipped) {
    g = 1.0f;
  } else if (unclipped > clipped) {
    g = inside;
  } else {
    g = 0.5f * (1.0f + inside);
  }
  return {-fminf(unclipped, clipped), unclipped * g};
}

}  // namespace ampd::kernels
