// CrossEntropyChunk's token losses on the CPU oracle (kernels/token_loss.h):
// cross_entropy with weights, importance_sampling, ppo, cispo and dro
// against a float64 reference written from the definitions (not from
// TokenLossTerm), the kernel's gradient against central finite differences
// of that reference's loss (cispo's clipped ratio held at its unperturbed
// value: the stop-gradient), the logprobs and token_losses outputs, the
// default terms giving the bits of the plain call, and the refusals; all
// of it at temperature 1 and at 0.7 (logp the log-softmax of z / 0.7, the
// gradient by the same differences, so with its 1 / T). LabelLogprobs
// gives CrossEntropyChunk's log-probs bit for bit, in every dtype. The
// CUDA backend is compared with this oracle in backend_ops_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;

constexpr int64_t kIgnore = -100;

struct Case {
  int64_t rows = 0;
  int64_t classes = 0;
  std::vector<double> z;  // (rows, classes)
  std::vector<int64_t> labels;
  std::vector<double> weights, advantages, sampling;  // (rows) each
};

// The parameters of the kinds that read them.
struct Params {
  double lo = 0.9, hi = 1.1;  // ppo, cispo: narrow, so some rows are clipped
  double beta = 0.5;          // dro
  double temperature = 1.0;   // every kind: logp of z / temperature
};

// Each kept row's term by the definitions, in double (0 for ignored rows):
// logp is the log-softmax of the label; r = exp(logp - q). cispo's clipped
// ratio is a constant of the loss (Tinker's .detach()): taken from
// `detached` logits when given (the finite differences hold it there), else
// from z.
std::vector<double> RefTerms(TokenLossKind kind, const Case& c, const std::vector<double>& z,
                             const Params& p, const std::vector<double>* detached = nullptr) {
  auto logp_of = [&](const std::vector<double>& logits, int64_t n) {
    const double* raw = &logits[static_cast<size_t>(n * c.classes)];
    std::vector<double> row(raw, raw + c.classes);
    for (double& v : row) v /= p.temperature;
    const double max = *std::max_element(row.begin(), row.end());
    double sum = 0.0;
    for (int64_t v = 0; v < c.classes; ++v) sum += std::exp(row[v] - max);
    return row[c.labels[n]] - max - std::log(sum);
  };
  std::vector<double> terms(static_cast<size_t>(c.rows), 0.0);
  for (int64_t n = 0; n < c.rows; ++n) {
    if (c.labels[n] == kIgnore) continue;
    const double logp = logp_of(z, n);
    const double q = c.sampling[n];
    const double r = std::exp(logp - q);
    const double a = c.advantages[n];
    double& term = terms[static_cast<size_t>(n)];
    switch (kind) {
      case TokenLossKind::kCrossEntropy:
        term = -c.weights[n] * logp;
        break;
      case TokenLossKind::kImportanceSampling:
        term = -r * a;
        break;
      case TokenLossKind::kPpo:
        term = -std::min(r * a, std::clamp(r, p.lo, p.hi) * a);
        break;
      case TokenLossKind::kCispo: {
        const double r_const = detached == nullptr ? r : std::exp(logp_of(*detached, n) - q);
        term = -(std::clamp(r_const, p.lo, p.hi) * logp * a);
        break;
      }
      case TokenLossKind::kDro:
        term = -(logp * a - 0.5 * p.beta * (logp - q) * (logp - q));
        break;
    }
  }
  return terms;
}

double RefLoss(TokenLossKind kind, const Case& c, const std::vector<double>& z, const Params& p,
               const std::vector<double>* detached = nullptr) {
  double total = 0.0;
  for (const double t : RefTerms(kind, c, z, p, detached)) total += t;
  return total;
}

Case RandomCase(std::mt19937_64& rng, int64_t rows, int64_t classes) {
  Case c;
  c.rows = rows;
  c.classes = classes;
  c.z = RandomValues(rng, DType::kF32, static_cast<size_t>(rows * classes), -3.0, 3.0);
  std::uniform_int_distribution<int64_t> pick(0, classes - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int64_t n = 0; n < rows; ++n) {
    c.labels.push_back(n % 7 == 3 ? kIgnore : pick(rng));
    c.weights.push_back(static_cast<float>(unit(rng) * 2.0));
    c.advantages.push_back(static_cast<float>(unit(rng) * 4.0 - 2.0));
    c.sampling.push_back(
        static_cast<float>(-std::log(static_cast<double>(classes)) + (unit(rng) - 0.5)));
  }
  return c;
}

class CpuTokenLossTest : public ::testing::TestWithParam<std::tuple<TokenLossKind, double>> {
 protected:
  Tensor Rows(const std::vector<double>& v) {
    return MakeTensor(*be_, DType::kF32, {static_cast<int64_t>(v.size())}, v);
  }
  Tensor Labels(const std::vector<int64_t>& labels) {
    std::vector<double> v(labels.begin(), labels.end());
    return MakeTensor(*be_, DType::kI64, {static_cast<int64_t>(labels.size())}, v);
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{20261126};
};

// The loss against the definitions, the gradient against central
// differences of them (fp32 logits: the kernel's one rounding is 2^-24
// relative), the logprobs output against the log-softmax, and the
// token_losses output against each row's term times loss_scale, summing to
// what the call added to loss.
TEST_P(CpuTokenLossTest, LossAndGradientMatchTheDefinitions) {
  const TokenLossKind kind = std::get<0>(GetParam());
  const Case c = RandomCase(rng_, 23, 11);
  Params p;
  p.temperature = std::get<1>(GetParam());
  Tensor z = MakeTensor(*be_, DType::kF32, {c.rows, c.classes}, c.z);
  Tensor labels = Labels(c.labels);
  Tensor weights = Rows(c.weights), advantages = Rows(c.advantages), sampling = Rows(c.sampling);
  Tensor logprobs = Rows(std::vector<double>(static_cast<size_t>(c.rows), 7.0));
  Tensor token_losses = Rows(std::vector<double>(static_cast<size_t>(c.rows), 7.0));
  TokenLossTerms terms;
  terms.kind = kind;
  terms.clip_low = static_cast<float>(p.lo);
  terms.clip_high = static_cast<float>(p.hi);
  terms.beta = static_cast<float>(p.beta);
  terms.temperature = static_cast<float>(p.temperature);
  if (kind == TokenLossKind::kCrossEntropy) {
    terms.weights = &weights;
  } else {
    terms.advantages = &advantages;
    terms.sampling_logprobs = &sampling;
  }
  terms.logprobs = &logprobs;
  terms.token_losses = &token_losses;
  const float grad_scale = 64.0f;  // the gradient's scale, apart from the loss's
  const float loss_scale = 2.0f;   // a loss_multiplier: each token's share carries it
  Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {0.5});
  Tensor dz =
      MakeTensor(*be_, DType::kF32, {c.rows, c.classes}, std::vector<double>(c.z.size(), 9.0));
  ASSERT_TRUE(
      be_->CrossEntropyChunk(z, labels, kIgnore, terms, loss_scale, grad_scale, loss, dz).ok());

  const double want = 0.5 + loss_scale * RefLoss(kind, c, c.z, p);
  const double got_loss = ReadTensor(*be_, loss)[0];
  EXPECT_NEAR(got_loss, want, 1e-5 * (1.0 + std::fabs(want)));
  const std::vector<double> ref_terms = RefTerms(kind, c, c.z, p);
  const std::vector<double> per_token = ReadTensor(*be_, token_losses);
  float added = 0.5f;  // the kernel's own order: row after row, in fp32
  for (int64_t n = 0; n < c.rows; ++n) {
    const auto i = static_cast<size_t>(n);
    const double want_i = loss_scale * ref_terms[i];
    EXPECT_NEAR(per_token[i], want_i, 1e-6 * (1.0 + std::fabs(want_i))) << n;
    if (c.labels[n] == kIgnore) {
      EXPECT_EQ(per_token[i], 0.0) << n;
    }
    added += static_cast<float>(per_token[i]);
  }
  EXPECT_EQ(added, static_cast<float>(got_loss));  // the very values added, in the same order
  const std::vector<double> got = ReadTensor(*be_, dz);
  const double h = 1e-6;
  int checked = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    std::vector<double> zp = c.z, zm = c.z;
    zp[i] += h;
    zm[i] -= h;
    const double fd = (RefLoss(kind, c, zp, p, &c.z) - RefLoss(kind, c, zm, p, &c.z)) / (2 * h);
    // A PPO row sitting on a clip edge has a kink; none of these does by
    // more than h, and the tolerance is the fp32 kernel's.
    EXPECT_NEAR(got[i] / grad_scale, fd, 2e-5 * (1.0 + std::fabs(fd))) << i;
    ++checked;
  }
  EXPECT_EQ(checked, c.rows * c.classes);
  const std::vector<double> lp = ReadTensor(*be_, logprobs);
  for (int64_t n = 0; n < c.rows; ++n) {
    if (c.labels[n] == kIgnore) {
      EXPECT_EQ(lp[n], 0.0) << n;
      continue;
    }
    const double* raw = &c.z[static_cast<size_t>(n * c.classes)];
    std::vector<double> row(raw, raw + c.classes);
    for (double& v : row) v /= p.temperature;
    const double max = *std::max_element(row.begin(), row.end());
    double sum = 0.0;
    for (int64_t v = 0; v < c.classes; ++v) sum += std::exp(row[v] - max);
    EXPECT_NEAR(lp[n], row[c.labels[n]] - max - std::log(sum), 1e-6) << n;
  }
  // LabelLogprobs: the same log-probs, bit for bit.
  Tensor alone = Rows(std::vector<double>(static_cast<size_t>(c.rows), 7.0));
  ASSERT_TRUE(be_->LabelLogprobs(z, labels, kIgnore, terms.temperature, alone).ok());
  EXPECT_EQ(testing::RawBytes(*be_, alone), testing::RawBytes(*be_, logprobs));
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, CpuTokenLossTest,
    ::testing::Combine(::testing::Values(TokenLossKind::kCrossEntropy,
                                         TokenLossKind::kImportanceSampling, TokenLossKind::kPpo,
                                         TokenLossKind::kCispo, TokenLossKind::kDro),
                       ::testing::Values(1.0, 0.7)),
    [](const ::testing::TestParamInfo<std::tuple<TokenLossKind, double>>& kind_info) {
      const std::string at = std::get<1>(kind_info.param) == 1.0 ? "" : "AtTemperature07";
      switch (std::get<0>(kind_info.param)) {
        case TokenLossKind::kCrossEntropy:
          return "CrossEntropy" + at;
        case TokenLossKind::kImportanceSampling:
          return "ImportanceSampling" + at;
        case TokenLossKind::kPpo:
          return "Ppo" + at;
        case TokenLossKind::kCispo:
          return "Cispo" + at;
        case TokenLossKind::kDro:
          return "Dro" + at;
      }
      return "Unknown" + at;
    });

// LabelLogprobs is CrossEntropyChunk's log-prob output, bit for bit, in
// every dtype and at any temperature, with the logits left as they were;
// ignored rows get 0; a bad label and a temperature <= 0 are refused.
TEST(CpuLabelLogprobs, EqualTheChunksLogprobsBitForBit) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  std::mt19937_64 rng(11);
  for (const DType dt : testing::kFloatTypes) {
    for (const float t : {1.0f, 0.7f, 1.9f}) {
      const std::vector<double> z = RandomValues(rng, dt, 9 * 13, -5.0, 5.0);
      Tensor lt = MakeTensor(*be, DType::kI64, {9}, {3, kIgnore, 0, 12, 5, 5, kIgnore, 1, 2});
      Tensor za = MakeTensor(*be, dt, {9, 13}, z), zb = MakeTensor(*be, dt, {9, 13}, z);
      Tensor loss = MakeTensor(*be, DType::kF32, {1}, {0.0});
      Tensor chunk = MakeTensor(*be, DType::kF32, {9}, std::vector<double>(9, 7.0));
      Tensor alone = MakeTensor(*be, DType::kF32, {9}, std::vector<double>(9, 7.0));
      TokenLossTerms terms;
      terms.temperature = t;
      terms.logprobs = &chunk;
      ASSERT_TRUE(be->CrossEntropyChunk(za, lt, kIgnore, terms, 1.0f, 1.0f, loss, za).ok());
      const std::vector<unsigned char> before = testing::RawBytes(*be, zb);
      ASSERT_TRUE(be->LabelLogprobs(zb, lt, kIgnore, t, alone).ok());
      EXPECT_EQ(testing::RawBytes(*be, alone), testing::RawBytes(*be, chunk))
          << DTypeName(dt) << " at " << t;
      EXPECT_EQ(testing::RawBytes(*be, zb), before) << "the logits were written";
      EXPECT_EQ(ReadTensor(*be, alone)[1], 0.0);
    }
  }
  Tensor z = MakeTensor(*be, DType::kF32, {2, 3}, std::vector<double>(6, 0.5));
  Tensor out = MakeTensor(*be, DType::kF32, {2}, {0.0, 0.0});
  Tensor bad = MakeTensor(*be, DType::kI32, {2}, {0, 3});
  EXPECT_EQ(be->LabelLogprobs(z, bad, kIgnore, 1.0f, out).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor good = MakeTensor(*be, DType::kI32, {2}, {0, 2});
  for (const float t : {0.0f, -1.0f, std::numeric_limits<float>::infinity()}) {
    const absl::Status s = be->LabelLogprobs(z, good, kIgnore, t, out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_NE(std::string(s.message()).find("temperature"), std::string::npos) << s;
  }
}

// Default terms are plain cross-entropy: the same bits as the call without
// terms, in every dtype (the GPT's own loss is unchanged by token losses).
TEST(CpuTokenLossDefaults, DefaultTermsGiveThePlainCallsBits) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  std::mt19937_64 rng(7);
  for (const DType dt : testing::kFloatTypes) {
    const std::vector<double> z = RandomValues(rng, dt, 9 * 13, -5.0, 5.0);
    std::vector<double> labels = {3, kIgnore, 0, 12, 5, 5, kIgnore, 1, 2};
    Tensor lt = MakeTensor(*be, DType::kI32, {9}, labels);
    Tensor za = MakeTensor(*be, dt, {9, 13}, z), zb = MakeTensor(*be, dt, {9, 13}, z);
    Tensor la = MakeTensor(*be, DType::kF32, {1}, {0.0}),
           lb = MakeTensor(*be, DType::kF32, {1}, {0.0});
    ASSERT_TRUE(be->CrossEntropyChunk(za, lt, kIgnore, 0.125f, 3.0f, la, za).ok());
    ASSERT_TRUE(
        be->CrossEntropyChunk(zb, lt, kIgnore, TokenLossTerms{}, 0.125f, 3.0f, lb, zb).ok());
    EXPECT_EQ(testing::RawBytes(*be, za), testing::RawBytes(*be, zb)) << DTypeName(dt);
    EXPECT_EQ(testing::RawBytes(*be, la), testing::RawBytes(*be, lb)) << DTypeName(dt);
  }
}

// Inputs the kind needs, inputs it does not read, wrong shapes and an
// unordered clip range are InvalidArgument naming the operand.
TEST(CpuTokenLossRefusals, BadTermsAreNamed) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  Tensor z = MakeTensor(*be, DType::kF32, {2, 3}, std::vector<double>(6, 0.5));
  Tensor labels = MakeTensor(*be, DType::kI32, {2}, {0, 2});
  Tensor loss = MakeTensor(*be, DType::kF32, {1}, {0.0});
  Tensor dz = MakeTensor(*be, DType::kF32, {2, 3}, std::vector<double>(6, 0.0));
  Tensor two = MakeTensor(*be, DType::kF32, {2}, {1.0, 1.0});
  Tensor three = MakeTensor(*be, DType::kF32, {3}, {1.0, 1.0, 1.0});
  auto expect = [&](const TokenLossTerms& terms, const std::string& operand) {
    const absl::Status s = be->CrossEntropyChunk(z, labels, kIgnore, terms, 1.0f, 1.0f, loss, dz);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << operand << ": " << s;
    EXPECT_NE(std::string(s.message()).find(operand), std::string::npos) << s;
  };
  TokenLossTerms is;
  is.kind = TokenLossKind::kImportanceSampling;
  expect(is, "advantages");  // required
  is.advantages = &two;
  is.sampling_logprobs = &three;
  expect(is, "sampling_logprobs");  // (3), not (2)
  is.sampling_logprobs = &two;
  is.weights = &two;
  expect(is, "weights");  // not read by importance sampling
  TokenLossTerms ppo = is;
  ppo.weights = nullptr;
  ppo.kind = TokenLossKind::kPpo;
  ppo.clip_low = 1.5f;
  expect(ppo, "clip_low");
  TokenLossTerms cispo = ppo;
  cispo.kind = TokenLossKind::kCispo;
  cispo.clip_low = 2.0f;  // above clip_high
  cispo.clip_high = 1.5f;
  expect(cispo, "clip_low");
  cispo.clip_low = 0.0f;
  cispo.clip_high = std::numeric_limits<float>::infinity();
  expect(cispo, "clip_high");
  TokenLossTerms dro = ppo;
  dro.kind = TokenLossKind::kDro;
  dro.beta = -0.5f;
  expect(dro, "beta");
  dro.beta = 0.5f;
  dro.weights = &two;
  expect(dro, "weights");  // not read by dro
  dro.weights = nullptr;
  dro.temperature = 0.0f;
  expect(dro, "temperature");
  TokenLossTerms ce;
  ce.logprobs = &three;
  expect(ce, "logprobs");
  ce.logprobs = nullptr;
  ce.token_losses = &three;
  expect(ce, "token_losses");
}

}  // namespace
}  // namespace ampd::kernels
