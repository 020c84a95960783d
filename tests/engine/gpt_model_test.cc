// The GPT model on the CPU backend against real references: its fp32 loss
// vs a float64 re-implementation written here from the definition (tied and
// untied heads, ignored targets, an LM head split over several chunks), its
// gradients vs central differences of its own loss for a sample of every
// parameter kind, the initialisation's distributions, and fp16 / bf16
// training through the Trainer with the loss scaler at work.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine_test_util.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using namespace ampd::engine::testing;

model::ModelSpec TinyGpt(int64_t vocab, int64_t context, int64_t d_model, int64_t n_layer,
                         int64_t n_head, bool tied = true) {
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::GptSpec g;
  g.vocab_size = vocab;
  g.context_length = context;
  g.d_model = d_model;
  g.n_layer = n_layer;
  g.n_head = n_head;
  g.tie_embeddings = tied;
  spec.kind = g;
  return spec;
}

using Weights = std::map<std::string, std::vector<float>>;

Weights ReadWeights(kernels::Backend& b, const model::Network& net) {
  Weights w;
  for (const model::Parameter& p : net.params()) {
    std::vector<float> v(static_cast<size_t>(p.master.numel()));
    EXPECT_TRUE(b.CopyToHost(p.master, v.data(), v.size() * 4).ok());
    w[p.name] = std::move(v);
  }
  return w;
}

// Moves every master off its init (LayerNorm's 1 and 0 would hide a swapped
// gradient; 0.02-scale weights make every branch nearly linear).
void Jitter(kernels::Backend& b, model::Network& net, uint64_t seed, float amount) {
  DataRng rng(seed);
  for (model::Parameter& p : net.params()) {
    std::vector<float> v(static_cast<size_t>(p.master.numel()));
    ASSERT_TRUE(b.CopyToHost(p.master, v.data(), v.size() * 4).ok());
    for (float& x : v) x += rng.Uniform(-amount, amount);
    ASSERT_TRUE(b.CopyFromHost(v.data(), v.size() * 4, p.master).ok());
  }
  ASSERT_TRUE(net.CastWorking().ok());
}

// Row-major (rows, in) @ (in, out).
std::vector<double> MatMul(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<float>& w, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < in; ++k) {
      const double a = x[static_cast<size_t>(r * in + k)];
      for (int64_t o = 0; o < out; ++o)
        y[static_cast<size_t>(r * out + o)] += a * w[static_cast<size_t>(k * out + o)];
    }
  }
  return y;
}

void AddBias(std::vector<double>& y, const std::vector<float>& bias) {
  const size_t c = bias.size();
  for (size_t i = 0; i < y.size(); ++i) y[i] += bias[i % c];
}

std::vector<double> LayerNormRef(const std::vector<double>& x, int64_t c,
                                 const std::vector<float>& gamma, const std::vector<float>& beta,
                                 double eps) {
  std::vector<double> y(x.size());
  const size_t rows = x.size() / static_cast<size_t>(c);
  for (size_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * static_cast<size_t>(c)];
    double mean = 0, var = 0;
    for (int64_t i = 0; i < c; ++i) mean += xr[i];
    mean /= static_cast<double>(c);
    for (int64_t i = 0; i < c; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<double>(c);
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < c; ++i) {
      y[r * static_cast<size_t>(c) + static_cast<size_t>(i)] =
          (xr[i] - mean) * rstd * gamma[static_cast<size_t>(i)] + beta[static_cast<size_t>(i)];
    }
  }
  return y;
}

// The GPT's loss in float64, from its definition (Hugging Face GPT-2's
// forward with the mean cross-entropy over targets other than -100).
double ReferenceLoss(const model::ModelSpec& spec, const Weights& w,
                     const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                     int64_t batch, int64_t seq) {
  const model::GptSpec& g = *spec.gpt();
  const int64_t c = g.d_model, n = batch * seq, heads = g.n_head, d = c / heads;
  const int64_t hidden = g.mlp_ratio * c;
  const double eps = g.layer_norm_eps;
  auto at = [&](const std::string& name) -> const std::vector<float>& { return w.at(name); };
  std::vector<double> x(static_cast<size_t>(n * c));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < c; ++i) {
      x[static_cast<size_t>(r * c + i)] =
          static_cast<double>(at(
              "transformer.wte.weight")[static_cast<size_t>(ids[static_cast<size_t>(r)] * c + i)]) +
          at("transformer.wpe.weight")[static_cast<size_t>((r % seq) * c + i)];
    }
  }
  for (int64_t l = 0; l < g.n_layer; ++l) {
    const std::string p = absl::StrCat("transformer.h.", l, ".");
    std::vector<double> a = LayerNormRef(x, c, at(p + "ln_1.weight"), at(p + "ln_1.bias"), eps);
    std::vector<double> qkv = MatMul(a, n, c, at(p + "attn.c_attn.weight"), 3 * c);
    AddBias(qkv, at(p + "attn.c_attn.bias"));
    std::vector<double> y(static_cast<size_t>(n * c), 0.0);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t t = 0; t < seq; ++t) {
          auto q = [&](int64_t row, int64_t part, int64_t k) {
            return qkv[static_cast<size_t>((b * seq + row) * 3 * c + part * c + h * d + k)];
          };
          std::vector<double> s(static_cast<size_t>(t + 1));
          double mx = -1e300;
          for (int64_t u = 0; u <= t; ++u) {
            double dot = 0;
            for (int64_t k = 0; k < d; ++k) dot += q(t, 0, k) * q(u, 1, k);
            s[static_cast<size_t>(u)] = dot / std::sqrt(static_cast<double>(d));
            mx = std::max(mx, s[static_cast<size_t>(u)]);
          }
          double z = 0;
          for (double& v : s) z += (v = std::exp(v - mx));
          for (int64_t k = 0; k < d; ++k) {
            double acc = 0;
            for (int64_t u = 0; u <= t; ++u) acc += s[static_cast<size_t>(u)] / z * q(u, 2, k);
            y[static_cast<size_t>((b * seq + t) * c + h * d + k)] = acc;
          }
        }
      }
    }
    std::vector<double> proj = MatMul(y, n, c, at(p + "attn.c_proj.weight"), c);
    AddBias(proj, at(p + "attn.c_proj.bias"));
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    std::vector<double> m = LayerNormRef(x, c, at(p + "ln_2.weight"), at(p + "ln_2.bias"), eps);
    std::vector<double> f = MatMul(m, n, c, at(p + "mlp.c_fc.weight"), hidden);
    AddBias(f, at(p + "mlp.c_fc.bias"));
    for (double& v : f) {
      v = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    }
    std::vector<double> out = MatMul(f, n, hidden, at(p + "mlp.c_proj.weight"), c);
    AddBias(out, at(p + "mlp.c_proj.bias"));
    for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
  }
  const std::vector<double> h =
      LayerNormRef(x, c, at("transformer.ln_f.weight"), at("transformer.ln_f.bias"), eps);
  const std::vector<float>& head =
      g.tie_embeddings ? at("transformer.wte.weight") : at("lm_head.weight");
  double total = 0;
  int64_t kept = 0;
  std::vector<double> logits(static_cast<size_t>(g.vocab_size));
  for (int64_t r = 0; r < n; ++r) {
    const int32_t target = targets[static_cast<size_t>(r)];
    if (target == -100) continue;
    double mx = -1e300;
    for (int64_t v = 0; v < g.vocab_size; ++v) {
      double dot = 0;
      for (int64_t i = 0; i < c; ++i) {
        dot += h[static_cast<size_t>(r * c + i)] * head[static_cast<size_t>(v * c + i)];
      }
      logits[static_cast<size_t>(v)] = dot;
      mx = std::max(mx, dot);
    }
    double z = 0;
    for (double v : logits) z += std::exp(v - mx);
    total += mx + std::log(z) - logits[static_cast<size_t>(target)];
    ++kept;
  }
  return static_cast<double>(spec.loss_multiplier) * total / static_cast<double>(kept);
}

struct Batch {
  int64_t batch, seq;
  std::vector<int32_t> ids, targets;
};

Batch RandomBatch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  DataRng rng(seed);
  Batch out{batch, seq, {}, {}};
  for (int64_t i = 0; i < batch * seq; ++i) {
    out.ids.push_back(rng.Index(static_cast<int32_t>(vocab)));
    // Every third target ignored, as padding would be.
    out.targets.push_back(i % 3 == 2 ? -100 : rng.Index(static_cast<int32_t>(vocab)));
  }
  return out;
}

// A GPT on the CPU backend; lm_head_chunk_bytes below its default splits a
// small head into several chunks.
class GptNet {
 public:
  GptNet(const model::ModelSpec& spec, model::Precision precision, uint64_t seed,
         int64_t lm_head_chunk_bytes = model::kLmHeadChunkBytes) {
    auto backend = kernels::CreateBackend("cpu");
    EXPECT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    auto net =
        model::TransformerModel::Create(spec, precision, seed, *backend_, lm_head_chunk_bytes);
    EXPECT_TRUE(net.ok()) << net.status();
    net_ = *std::move(net);
    auto loss = backend_->Allocate(DType::kF32, {1, 1});
    EXPECT_TRUE(loss.ok());
    loss_ = *std::move(loss);
  }
  kernels::Backend& backend() { return *backend_; }
  model::Network& net() { return *net_; }

  absl::Status Load(const Batch& data) {
    AMPD_ASSIGN_OR_RETURN(ws_, net_->GetWorkspace({data.batch, data.seq}));
    return net_->LoadBatch(I32({data.batch, data.seq}, data.ids),
                           I32({data.batch, data.seq}, data.targets), *ws_);
  }
  // Forward and Loss; the loss as the backend stored it.
  absl::StatusOr<float> Loss(float grad_scale = 1.0f) {
    AMPD_RETURN_IF_ERROR(net_->Forward(*ws_));
    AMPD_RETURN_IF_ERROR(net_->Loss(*ws_, grad_scale, loss_));
    float l = 0;
    AMPD_RETURN_IF_ERROR(backend_->CopyToHost(loss_, &l, 4));
    return l;
  }
  // Forward and EvalLoss (an evaluation's loss).
  absl::StatusOr<float> EvalLoss() {
    AMPD_RETURN_IF_ERROR(net_->Forward(*ws_));
    AMPD_RETURN_IF_ERROR(net_->EvalLoss(*ws_, loss_));
    float l = 0;
    AMPD_RETURN_IF_ERROR(backend_->CopyToHost(loss_, &l, 4));
    return l;
  }
  absl::Status Backward() { return net_->Backward(*ws_, /*first_micro_batch=*/true); }
  model::Workspace& workspace() { return *ws_; }

 private:
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Network> net_;
  model::Workspace* ws_ = nullptr;
  kernels::Tensor loss_;
};

void ExpectForwardMatchesReference(const model::ModelSpec& spec, const Batch& data,
                                   int64_t lm_head_chunk_bytes = model::kLmHeadChunkBytes) {
  GptNet m(spec, model::Precision::kFp32, 5, lm_head_chunk_bytes);
  Jitter(m.backend(), m.net(), 17, 0.1f);
  ASSERT_TRUE(m.Load(data).ok());
  absl::StatusOr<float> loss = m.Loss();
  ASSERT_TRUE(loss.ok()) << loss.status();
  const double want = ReferenceLoss(spec, ReadWeights(m.backend(), m.net()), data.ids, data.targets,
                                    data.batch, data.seq);
  EXPECT_NEAR(*loss, want, 2e-6 * std::fabs(want) + 1e-6) << "want " << want;
}

TEST(GptForward, Fp32LossMatchesFloat64Reference) {
  model::ModelSpec spec = TinyGpt(13, 8, 16, 2, 4);
  spec.loss_multiplier = 1.5f;
  ExpectForwardMatchesReference(spec, RandomBatch(3, 7, 13, 1));
  // Untied head, a shorter sequence, another MLP ratio and eps.
  model::ModelSpec untied = TinyGpt(13, 8, 16, 3, 2, /*tied=*/false);
  untied.gpt()->mlp_ratio = 3;
  untied.gpt()->layer_norm_eps = 1e-3f;
  ExpectForwardMatchesReference(untied, RandomBatch(2, 4, 13, 2));
}

// Bytes of `rows` rows of a V-token head's logits in `dtype_bytes`.
int64_t LogitBytes(int64_t rows, int64_t vocab, int64_t dtype_bytes) {
  return rows * vocab * dtype_bytes;
}

TEST(GptForward, ChunkedLmHeadMatchesReference) {
  // Room for 3 rows of fp32 logits: 10 rows take four chunks of 3, 3, 3, 1.
  const int64_t vocab = 29;
  const model::ModelSpec spec = TinyGpt(vocab, 6, 8, 1, 2);
  const int64_t chunk_bytes = LogitBytes(3, vocab, 4);
  ASSERT_EQ(
      model::LmHeadChunkRows(spec.gpt()->vocab_size, model::Precision::kFp32, 10, chunk_bytes), 3);
  ExpectForwardMatchesReference(spec, RandomBatch(2, 5, vocab, 3), chunk_bytes);
}

// The chunks: all rows while they fit, else the fewest chunks, as even as
// they can be, each within the bytes (at least a row each).
TEST(GptForward, LmHeadChunkRowsTakeTheFewestEvenChunks) {
  const model::ModelSpec spec = TinyGpt(100, 6, 8, 1, 2);
  const model::GptSpec& g = *spec.gpt();
  const model::Precision bf16 = model::Precision::kBf16;
  const model::Precision fp32 = model::Precision::kFp32;
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 8192), 8192);  // 1.6 MB: one chunk
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 10, LogitBytes(10, 100, 2)), 10);
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, fp32, 10, LogitBytes(10, 100, 2)), 5);  // 2 of 5
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 10, LogitBytes(4, 100, 2)), 4);   // 4, 4, 2
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 9, LogitBytes(4, 100, 2)), 3);    // 3, 3, 3
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 10, LogitBytes(4, 100, 2) + 1), 4);
  EXPECT_EQ(model::LmHeadChunkRows(g.vocab_size, bf16, 10, 1), 1);  // less than a row: a row each
  // GPT-2 small's 8 x 1024 tokens: four chunks in bf16 (823 MB), seven in
  // fp32 (1.65 GB), never more than 256 MiB of logits whatever the batch.
  const model::ModelSpec gpt2 = TinyGpt(50257, 1024, 768, 12, 12);
  EXPECT_EQ(model::LmHeadChunkRows(gpt2.gpt()->vocab_size, bf16, 8192), 2048);
  EXPECT_EQ(model::LmHeadChunkRows(gpt2.gpt()->vocab_size, fp32, 8192), 1171);
  EXPECT_EQ(model::LmHeadChunkRows(gpt2.gpt()->vocab_size, bf16, 32768), 2521);  // 13 chunks
  // A 32k vocabulary, 64 x 256 tokens in fp16 (1 GiB): four chunks.
  EXPECT_EQ(model::LmHeadChunkRows(32000, model::Precision::kFp16, 64 * 256), 4096);
  for (const int64_t rows : {int64_t{1}, int64_t{8192}, int64_t{1} << 20}) {
    EXPECT_LE(model::LmHeadChunkRows(gpt2.gpt()->vocab_size, bf16, rows) * 50257 * 2,
              model::kLmHeadChunkBytes);
  }
}

// In bf16 the head's gradient is summed over chunks in fp32 and added once:
// with the same weights it agrees with the fp32 model's (room for 15 rows of
// bf16 logits here, so 40 rows take three chunks of 14, 14, 12; the fp32
// model takes six of 7).
// Every parameter's gradient, byte for byte.
std::vector<std::vector<char>> GradBytes(kernels::Backend& b, const model::Network& net) {
  std::vector<std::vector<char>> out;
  for (const model::Parameter& p : net.params()) {
    std::vector<char> bytes(p.grad.nbytes());
    EXPECT_TRUE(b.CopyToHost(p.grad, bytes.data(), bytes.size()).ok());
    out.push_back(std::move(bytes));
  }
  return out;
}

// An evaluation's loss is the step's, and the LM head it runs (in one
// chunk, and in several) leaves every gradient as the step left it.
TEST(GptForward, EvalLossIsTheLossAndLeavesGradientsAlone) {
  const int64_t vocab = 97;
  const model::ModelSpec spec = TinyGpt(vocab, 20, 8, 1, 2);
  const Batch data = RandomBatch(2, 20, vocab, 9);
  for (const int64_t chunk_bytes : {model::kLmHeadChunkBytes, LogitBytes(20, vocab, 2)}) {
    SCOPED_TRACE(chunk_bytes);
    for (model::Precision precision :
         {model::Precision::kFp32, model::Precision::kBf16, model::Precision::kFp16}) {
      GptNet m(spec, precision, 4, chunk_bytes);
      ASSERT_TRUE(m.Load(data).ok());
      ASSERT_TRUE(m.net().ZeroGrads().ok());
      absl::StatusOr<float> loss = m.Loss(/*grad_scale=*/256.0f);
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(m.Backward().ok());
      const std::vector<std::vector<char>> before = GradBytes(m.backend(), m.net());
      absl::StatusOr<float> evaluated = m.EvalLoss();
      ASSERT_TRUE(evaluated.ok()) << evaluated.status();
      EXPECT_EQ(*evaluated, *loss) << model::PrecisionName(precision);
      EXPECT_TRUE(GradBytes(m.backend(), m.net()) == before) << model::PrecisionName(precision);
    }
  }
}

// The head in chunks is the head in one chunk, row by row: on a
// batch-invariant backend the loss, every token's log-prob and every
// gradient the head's dh feeds (all but the head's own weight gradient, a
// sum over the rows that the chunks associate differently: the next tests)
// are the same bits, in each precision, for one chunk of 40 rows and for
// chunks of 7 (6 chunks, the last of 5).
TEST(GptForward, ChunkedHeadIsTheOneChunkHeadBitForBit) {
  const int64_t vocab = 53;
  const model::ModelSpec spec = TinyGpt(vocab, 20, 16, 2, 2, /*tied=*/false);
  const Batch data = RandomBatch(2, 20, vocab, 21);
  for (model::Precision precision :
       {model::Precision::kFp32, model::Precision::kBf16, model::Precision::kFp16}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    const auto w = static_cast<int64_t>(kernels::SizeOf(model::WorkingDType(precision)));
    const int64_t split_bytes = LogitBytes(7, vocab, w);
    ASSERT_EQ(model::LmHeadChunkRows(vocab, precision, 40, split_bytes), 7);
    ASSERT_EQ(model::LmHeadChunkRows(vocab, precision, 40), 40);
    float losses[2] = {};
    std::vector<float> logprobs[2];
    std::vector<std::vector<char>> grads[2];
    for (int k = 0; k < 2; ++k) {
      GptNet m(spec, precision, 6, k == 0 ? model::kLmHeadChunkBytes : split_bytes);
      ASSERT_TRUE(m.backend().SetBatchInvariant(true).ok());
      ASSERT_TRUE(m.net().ZeroGrads().ok());
      ASSERT_TRUE(m.Load(data).ok());
      // The batch again, asking for each token's log-prob.
      model::TokenLossInputs tokens;
      tokens.logprobs = true;
      ASSERT_TRUE(m.net()
                      .LoadBatch(I32({data.batch, data.seq}, data.ids),
                                 I32({data.batch, data.seq}, data.targets), tokens, m.workspace())
                      .ok());
      absl::StatusOr<float> loss = m.Loss(/*grad_scale=*/64.0f);
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses[k] = *loss;
      absl::StatusOr<const kernels::Tensor*> lp = m.net().TokenLogprobs(m.workspace());
      ASSERT_TRUE(lp.ok()) << lp.status();
      logprobs[k].resize(static_cast<size_t>((*lp)->numel()));
      ASSERT_TRUE(m.backend().CopyToHost(**lp, logprobs[k].data(), logprobs[k].size() * 4).ok());
      ASSERT_TRUE(m.Backward().ok());
      grads[k] = GradBytes(m.backend(), m.net());
      for (size_t i = 0; i < m.net().params().size(); ++i) {
        if (m.net().params()[i].name == "lm_head.weight") grads[k][i].clear();
      }
    }
    EXPECT_EQ(std::memcmp(&losses[0], &losses[1], 4), 0) << losses[0] << " vs " << losses[1];
    EXPECT_TRUE(logprobs[0] == logprobs[1]);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_TRUE(grads[0][i] == grads[1][i]) << "gradient " << i;
    }
  }
}

// Tied and untied heads: every parameter is reported once, when backward
// has finished it (a tied wte only after the embedding's backward).
TEST(GptBackward, ReportsEachGradientOnceWhenItIsFinal) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const model::ModelSpec spec = TinyGpt(13, 8, 16, 2, 4, tied);
    GptNet m(spec, model::Precision::kFp32, 3);
    ASSERT_TRUE(m.Load(RandomBatch(2, 8, 13, 5)).ok());
    ASSERT_TRUE(m.net().ZeroGrads().ok());
    ASSERT_TRUE(m.Loss().ok());
    testing::ExpectGradsReadyOnceAndFinal(m.backend(), m.net(), m.workspace());
  }
}

TEST(GptBackward, ChunkedHeadGradientInBf16AgreesWithFp32) {
  const int64_t vocab = 97;
  const model::ModelSpec spec = TinyGpt(vocab, 20, 8, 1, 2);
  const int64_t chunk_bytes = LogitBytes(15, vocab, 2);
  ASSERT_EQ(
      model::LmHeadChunkRows(spec.gpt()->vocab_size, model::Precision::kBf16, 40, chunk_bytes), 14);
  const Batch data = RandomBatch(2, 20, vocab, 6);
  std::vector<float> grads[2];
  Weights weights;
  int k = 0;
  for (model::Precision precision : {model::Precision::kFp32, model::Precision::kBf16}) {
    GptNet m(spec, precision, 3, chunk_bytes);
    if (weights.empty()) {
      Jitter(m.backend(), m.net(), 41, 0.2f);
      weights = ReadWeights(m.backend(), m.net());
    } else {
      for (model::Parameter& p : m.net().params()) {
        const std::vector<float>& w = weights.at(p.name);
        ASSERT_TRUE(m.backend().CopyFromHost(w.data(), w.size() * 4, p.master).ok());
      }
      ASSERT_TRUE(m.net().CastWorking().ok());
    }
    ASSERT_TRUE(m.Load(data).ok());
    ASSERT_TRUE(m.net().ZeroGrads().ok());
    ASSERT_TRUE(m.Loss(/*grad_scale=*/1024.0f).ok());
    ASSERT_TRUE(m.Backward().ok());
    const model::Parameter& wte = m.net().params()[0];
    ASSERT_EQ(wte.name, "transformer.wte.weight");
    std::vector<float> g(static_cast<size_t>(wte.grad.numel()));
    if (precision == model::Precision::kFp32) {
      ASSERT_TRUE(m.backend().CopyToHost(wte.grad, g.data(), g.size() * 4).ok());
    } else {
      auto f32 = m.backend().Allocate(DType::kF32, wte.grad.shape());
      ASSERT_TRUE(f32.ok());
      ASSERT_TRUE(m.backend().Cast(wte.grad, *f32).ok());
      ASSERT_TRUE(m.backend().CopyToHost(*f32, g.data(), g.size() * 4).ok());
    }
    grads[k++] = std::move(g);
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    const double d = static_cast<double>(grads[1][i]) - grads[0][i];
    diff += d * d;
    norm += static_cast<double>(grads[0][i]) * grads[0][i];
  }
  ASSERT_GT(norm, 0.0);
  EXPECT_LT(std::sqrt(diff / norm), 0.05);
}

// A parameter's gradient as floats (16-bit gradients widened exactly).
std::vector<float> GradFloats(kernels::Backend& b, const model::Parameter& p) {
  std::vector<float> g(static_cast<size_t>(p.grad.numel()));
  if (p.grad.dtype() == DType::kF32) {
    EXPECT_TRUE(b.CopyToHost(p.grad, g.data(), g.size() * 4).ok());
    return g;
  }
  auto f32 = b.Allocate(DType::kF32, p.grad.shape());
  EXPECT_TRUE(f32.ok());
  EXPECT_TRUE(b.Cast(p.grad, *f32).ok());
  EXPECT_TRUE(b.CopyToHost(*f32, g.data(), g.size() * 4).ok());
  return g;
}

// One unit in the last place of a 16-bit dtype at magnitude m (its
// subnormal quantum below the normal range).
double Ulp16(DType dtype, double m) {
  const int mantissa = dtype == DType::kF16 ? 10 : 7;
  const int min_exponent = dtype == DType::kF16 ? -14 : -126;
  const int e = m > 0 ? std::max(std::ilogb(m), min_exponent) : min_exponent;
  return std::ldexp(1.0, e - mantissa);
}

// The LM head's rounding contract: each micro-batch's weight gradient is
// added to the gradient in one rounding to its dtype, whether the head runs
// as one GEMM into the gradient (one chunk) or as chunks summed in fp32 and
// added once. The two differ only in how the fp32 sum is associated, so
// after two micro-batches each 16-bit element agrees to within a unit in
// the last place per micro-batch, and almost every element exactly (a
// second rounding, of the sum before it is added, would part them far more
// often); fp32 agrees within fp32 summation error. The single chunk holds
// no F32 sum. An untied head, whose gradient comes from the head alone.
TEST(GptBackward, HeadGradientOfOneChunkAndOfSeveralAgreeWithinOneRounding) {
  const int64_t vocab = 97, c = 8, rows = 40;
  const model::ModelSpec spec = TinyGpt(vocab, 20, c, 1, 2, /*tied=*/false);
  const Batch data[2] = {RandomBatch(2, 20, vocab, 12), RandomBatch(2, 20, vocab, 13)};
  const int64_t split_bytes = LogitBytes(15, vocab, 2);
  for (model::Precision precision :
       {model::Precision::kFp32, model::Precision::kBf16, model::Precision::kFp16}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    const DType dtype = model::WorkingDType(precision);
    const auto w = static_cast<int64_t>(kernels::SizeOf(dtype));
    const int64_t split_rows =
        model::LmHeadChunkRows(spec.gpt()->vocab_size, precision, rows, split_bytes);
    ASSERT_LT(split_rows, rows);
    ASSERT_EQ(model::LmHeadChunkRows(spec.gpt()->vocab_size, precision, rows), rows);
    std::vector<float> grads[2];
    float losses[2] = {};
    int64_t workspace[2] = {};
    for (int k = 0; k < 2; ++k) {
      GptNet m(spec, precision, 3, k == 0 ? model::kLmHeadChunkBytes : split_bytes);
      Jitter(m.backend(), m.net(), 43, 0.2f);
      ASSERT_TRUE(m.net().ZeroGrads().ok());
      for (int mb = 0; mb < 2; ++mb) {
        ASSERT_TRUE(m.Load(data[mb]).ok());
        absl::StatusOr<float> loss = m.Loss(/*grad_scale=*/256.0f);
        ASSERT_TRUE(loss.ok()) << loss.status();
        losses[k] += *loss;
        ASSERT_TRUE(m.net().Backward(m.workspace(), /*first_micro_batch=*/mb == 0).ok());
      }
      const model::Parameter& head = m.net().params().back();
      ASSERT_EQ(head.name, "lm_head.weight");
      grads[k] = GradFloats(m.backend(), head);
      workspace[k] = m.net().cached_workspace_bytes();
    }
    // The single chunk's logits are all 40 rows, and a 16-bit head split in
    // chunks also holds the (V, C) F32 sum.
    EXPECT_EQ(workspace[0] - workspace[1],
              (rows - split_rows) * vocab * w - (w == 4 ? 0 : vocab * c * 4));
    EXPECT_NEAR(losses[0], losses[1], 1e-6 * std::fabs(losses[0]));
    double largest = 0;
    for (float g : grads[0]) largest = std::max(largest, std::fabs(static_cast<double>(g)));
    ASSERT_GT(largest, 0.0);
    int differ = 0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      const double a = grads[0][i], b = grads[1][i];
      const double bound =
          w == 4 ? 1e-5 * largest : 2 * Ulp16(dtype, std::max(std::fabs(a), std::fabs(b)));
      EXPECT_LE(std::fabs(a - b), bound) << "lm_head.weight[" << i << "]: " << a << " vs " << b;
      differ += a != b ? 1 : 0;
    }
    if (w != 4) {
      EXPECT_LE(differ, static_cast<int>(grads[0].size() / 50));
    }
    std::printf("%s: %d of %zu head-gradient elements differ between 1 and several chunks\n",
                std::string(model::PrecisionName(precision)).c_str(), differ, grads[0].size());
  }
}

TEST(GptBackward, GradientsMatchCentralDifferencesForEveryParameterKind) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const model::ModelSpec spec = TinyGpt(7, 6, 8, 2, 2, tied);
    GptNet m(spec, model::Precision::kFp32, 9);
    Jitter(m.backend(), m.net(), 23, 0.3f);
    const Batch data = RandomBatch(2, 5, 7, 4);
    ASSERT_TRUE(m.Load(data).ok());
    ASSERT_TRUE(m.net().ZeroGrads().ok());
    ASSERT_TRUE(m.Loss().ok());
    ASSERT_TRUE(m.Backward().ok());
    kernels::Backend& b = m.backend();
    // Every gradient read before the differences run: Loss itself adds to
    // the LM head's gradient each time it runs.
    std::map<std::string, std::vector<float>> grads;
    for (model::Parameter& p : m.net().params()) {
      std::vector<float> g(static_cast<size_t>(p.master.numel()));
      ASSERT_TRUE(b.CopyToHost(p.grad, g.data(), g.size() * 4).ok());
      grads[p.name] = std::move(g);
    }
    int checked = 0;
    DataRng pick(31);
    for (model::Parameter& p : m.net().params()) {
      const auto n = static_cast<size_t>(p.master.numel());
      std::vector<float> w(n);
      ASSERT_TRUE(b.CopyToHost(p.master, w.data(), n * 4).ok());
      const std::vector<float>& g = grads[p.name];
      // Four elements of every tensor; for the position table only rows
      // below T carry a gradient, and a row at T must have none.
      std::vector<size_t> sample;
      for (int k = 0; k < 4; ++k)
        sample.push_back(static_cast<size_t>(pick.Index(static_cast<int32_t>(n))));
      if (absl::StrContains(p.name, "wpe")) {
        const size_t c = 8;
        for (size_t& i : sample) i %= static_cast<size_t>(data.seq) * c;
        sample.push_back(static_cast<size_t>(data.seq) * c + 1);
      }
      for (size_t i : sample) {
        const float h = 1e-2f;
        std::vector<float> wp = w;
        wp[i] = w[i] + h;
        ASSERT_TRUE(b.CopyFromHost(wp.data(), n * 4, p.master).ok());
        const double lp = *m.Loss();
        wp[i] = w[i] - h;
        ASSERT_TRUE(b.CopyFromHost(wp.data(), n * 4, p.master).ok());
        const double lm = *m.Loss();
        ASSERT_TRUE(b.CopyFromHost(w.data(), n * 4, p.master).ok());
        const double fd = (lp - lm) / (2.0 * static_cast<double>(h));
        EXPECT_NEAR(g[i], fd, 2e-3 + 1e-2 * std::fabs(fd)) << p.name << "[" << i << "]";
        ++checked;
      }
    }
    EXPECT_GE(checked, 4 * static_cast<int>(m.net().params().size()));
  }
}

TEST(GptInit, NanoGptDistributionsFromTheSeed) {
  const model::ModelSpec spec = TinyGpt(512, 64, 64, 4, 4);
  GptNet a(spec, model::Precision::kBf16, 42);
  GptNet same(spec, model::Precision::kBf16, 42);
  const Weights w = ReadWeights(a.backend(), a.net());
  EXPECT_EQ(w, ReadWeights(same.backend(), same.net()));
  ASSERT_EQ(a.net().params().size(), 2u + 4u * 12u + 2u);
  EXPECT_EQ(a.net().params()[0].name, "transformer.wte.weight");
  EXPECT_EQ(a.net().params()[4].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(a.net().params().back().name, "transformer.ln_f.bias");
  EXPECT_EQ(a.net().parameter_count(), model::ParameterCount(spec));
  auto stddev = [](const std::vector<float>& v) {
    double sq = 0;
    for (float x : v) sq += static_cast<double>(x) * x;
    return std::sqrt(sq / static_cast<double>(v.size()));
  };
  EXPECT_NEAR(stddev(w.at("transformer.wte.weight")), 0.02, 0.001);
  EXPECT_NEAR(stddev(w.at("transformer.h.1.mlp.c_fc.weight")), 0.02, 0.001);
  EXPECT_NEAR(stddev(w.at("transformer.h.2.attn.c_proj.weight")), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_NEAR(stddev(w.at("transformer.h.3.mlp.c_proj.weight")), 0.02 / std::sqrt(8.0), 0.0005);
  for (float x : w.at("transformer.h.0.ln_1.weight")) EXPECT_EQ(x, 1.0f);
  for (float x : w.at("transformer.h.0.attn.c_attn.bias")) EXPECT_EQ(x, 0.0f);
  // Each tensor its own stream: equal shapes, different draws.
  EXPECT_NE(w.at("transformer.h.0.mlp.c_fc.weight"), w.at("transformer.h.1.mlp.c_fc.weight"));
}

// A token loss's per-token buffers stay with the workspace: once a batch
// with every input and the log-probs has run, plain and token-loss batches
// in any order allocate nothing more, and a plain batch reads none of the
// previous batch's inputs (its loss is the mean again).
TEST(GptWorkspace, TokenLossBuffersAreKeptAndNotReadByALaterPlainBatch) {
  const model::ModelSpec spec = TinyGpt(50, 16, 32, 1, 4, /*tied=*/true);
  GptNet m(spec, model::Precision::kFp32, 1);
  const Batch data = RandomBatch(2, 6, 50, 9);
  const HostTensor ids = I32({2, 6}, data.ids);
  const HostTensor targets = I32({2, 6}, data.targets);
  HostTensor ones{DType::kF32, {2, 6}, std::string(12 * sizeof(float), '\0')};
  for (int i = 0; i < 12; ++i) {
    const float one = 1.0f;
    std::memcpy(ones.data.data() + i * sizeof(float), &one, sizeof(float));
  }
  model::TokenLossInputs ppo;
  ppo.fn.kind = LossFnKind::kPpo;
  ppo.advantages = &ones;
  ppo.sampling_logprobs = &ones;
  ppo.weights = nullptr;
  ppo.logprobs = true;
  model::TokenLossInputs weighted;
  weighted.fn.kind = LossFnKind::kCrossEntropy;
  weighted.weights = &ones;

  ASSERT_TRUE(m.Load(data).ok());
  absl::StatusOr<float> mean = m.Loss();
  ASSERT_TRUE(mean.ok()) << mean.status();
  ASSERT_TRUE(m.net().LoadBatch(ids, targets, ppo, m.workspace()).ok());
  ASSERT_TRUE(m.Loss().ok());
  ASSERT_TRUE(m.net().LoadBatch(ids, targets, weighted, m.workspace()).ok());
  absl::StatusOr<float> summed = m.Loss();
  ASSERT_TRUE(summed.ok()) << summed.status();
  const int64_t warm = m.backend().BytesInUse();
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(m.Load(data).ok());
    absl::StatusOr<float> again = m.Loss();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *mean);  // no weights or log-probs of the batch before
    EXPECT_FALSE(m.net().TokenLogprobs(m.workspace()).ok());
    ASSERT_TRUE(m.net().LoadBatch(ids, targets, ppo, m.workspace()).ok());
    ASSERT_TRUE(m.Loss().ok());
    EXPECT_TRUE(m.net().TokenLogprobs(m.workspace()).ok());
    EXPECT_EQ(m.backend().BytesInUse(), warm);
  }
  // Weights of 1 sum what the mean averages over the kept targets.
  int64_t kept = 0;
  for (const int64_t t : data.targets) kept += t != model::kIgnoreIndex ? 1 : 0;
  EXPECT_NEAR(*summed, *mean * static_cast<float>(kept), 1e-4f * *summed);
}

// WorkspaceBytes is what admission holds a step to: an upper bound of what
// the workspace allocates (ids and targets included), tight to the byte for
// the float buffers, refused for shapes the model cannot take and for
// products that overflow.
TEST(GptWorkspace, BytesBoundTheAllocationAndOverflowIsRefused) {
  const model::ModelSpec spec = TinyGpt(50, 16, 32, 3, 4, /*tied=*/false);
  // The head in one chunk (no F32 sum), and in chunks of 7 rows (with it).
  for (const int64_t chunk_bytes : {model::kLmHeadChunkBytes, LogitBytes(7, 50, 2)}) {
    SCOPED_TRACE(chunk_bytes);
    GptNet m(spec, model::Precision::kBf16, 1, chunk_bytes);
    const int64_t before = m.backend().BytesInUse();
    const Batch data = RandomBatch(3, 10, 50, 5);
    ASSERT_TRUE(m.Load(data).ok());
    const int64_t used = m.backend().BytesInUse() - before;
    absl::StatusOr<int64_t> bytes =
        model::TransformerWorkspaceBytes(spec, model::Precision::kBf16, {3, 10}, chunk_bytes);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    // ids and targets are I32 here, counted as I64: 2 x 30 x 4 bytes of slack.
    // The token loss's five (N) F32 buffers (three inputs, the log-probs,
    // the per-token losses) are counted and allocated only by a step that
    // uses them: 5 x 30 x 4 more.
    EXPECT_EQ(*bytes - used, 2 * 30 * 4 + 5 * 30 * 4);
    EXPECT_EQ(m.net().cached_workspace_bytes(), *bytes);
  }
  // What admission counts is the default chunking's.
  EXPECT_EQ(model::WorkspaceBytes(spec, model::Precision::kBf16, {3, 10}).value(),
            model::TransformerWorkspaceBytes(spec, model::Precision::kBf16, {3, 10}).value());

  EXPECT_EQ(model::WorkspaceBytes(spec, model::Precision::kBf16, {3, 17}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model::WorkspaceBytes(spec, model::Precision::kBf16, {30}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status huge =
      model::WorkspaceBytes(spec, model::Precision::kBf16, {int64_t{1} << 50, 16}).status();
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(huge.message(), "more than 2^63 bytes")) << huge;
}

// Sequences of a fixed rule (next = (3 t + 1) mod V after a random start):
// the loss can fall far below ln V.
StepInput RuleBatch(int64_t batch, int64_t seq, int64_t vocab, DataRng& rng) {
  std::vector<int32_t> ids, targets;
  for (int64_t b = 0; b < batch; ++b) {
    int32_t t = rng.Index(static_cast<int32_t>(vocab));
    for (int64_t s = 0; s < seq; ++s) {
      ids.push_back(t);
      t = static_cast<int32_t>((3 * t + 1) % vocab);
      targets.push_back(t);
    }
  }
  StepInput input;
  input.micro_batches.push_back({I32({batch, seq}, ids), I32({batch, seq}, targets)});
  return input;
}

JobConfig GptConfig(model::Precision precision) {
  JobConfig config = DefaultJobConfig(precision);
  config.model = TinyGpt(32, 16, 32, 2, 4);
  config.optimizer.adam.lr = 3e-3f;
  config.seed = 3;
  return config;
}

TEST(GptTraining, Bf16AndFp16LossFallsWithTheScalerAtWork) {
  for (model::Precision precision : {model::Precision::kBf16, model::Precision::kFp16}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    JobConfig config = GptConfig(precision);
    if (precision == model::Precision::kFp16) {
      // A scale far above what fp16 gradients survive: the first steps
      // overflow and are skipped while the scaler backs off.
      config.scaler.init_scale = 0x1p40;
    }
    std::unique_ptr<Trainer> trainer = MakeTrainer(config);
    ASSERT_NE(trainer, nullptr);
    DataRng rng(8);
    std::vector<float> losses;
    int skipped = 0;
    for (int step = 0; step < 80; ++step) {
      absl::StatusOr<StepReport> r = trainer->Step(RuleBatch(4, 16, 32, rng));
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->scaler.skipped) {
        ++skipped;
        continue;
      }
      EXPECT_TRUE(std::isfinite(r->loss));
      losses.push_back(r->loss);
    }
    ASSERT_GE(losses.size(), 40u);
    double first = 0, last = 0;
    for (size_t i = 0; i < 5; ++i) first += losses[i] / 5.0;
    for (size_t i = losses.size() - 5; i < losses.size(); ++i) last += losses[i] / 5.0;
    EXPECT_GT(first, 0.8 * std::log(32.0));
    EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
    if (precision == model::Precision::kFp16) {
      EXPECT_GT(skipped, 0);
      EXPECT_LT(trainer->scaler().scale, 0x1p40);
      EXPECT_EQ(trainer->applied_steps(), 80 - skipped);
    } else {
      EXPECT_EQ(skipped, 0);
    }
  }
}

// A Hugging Face GPT-2 file (names without "transformer.", attention mask
// buffers the model ignores) loads as weights alone; what a job checkpoints
// of it, arranged without reading the device back, is what ExportState
// reads back once it is loaded.
TEST(GptState, HuggingFaceFileArrangedForLoadIsWhatExportStateReadsBack) {
  std::unique_ptr<Trainer> source = MakeTrainer(GptConfig(model::Precision::kBf16));
  JobConfig config = GptConfig(model::Precision::kBf16);
  config.seed = 4;
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(source && trainer);
  absl::StatusOr<checkpoint::StateDict> exported = source->ExportState();
  ASSERT_TRUE(exported.ok()) << exported.status();
  checkpoint::StateDict hf;
  for (const codec::NamedTensor& n : exported->tensors) {
    if (absl::StartsWith(n.name, "optimizer.")) continue;
    codec::NamedTensor renamed = n;
    if (absl::StartsWith(n.name, "transformer.")) renamed.name = n.name.substr(12);
    hf.tensors.push_back(std::move(renamed));
  }
  hf.tensors.push_back({"h.0.attn.bias", F32({1}, {1.0f})});
  absl::StatusOr<checkpoint::StateDict> arranged =
      trainer->ArrangeForLoad(hf, Trainer::StepCount::kKeep);
  ASSERT_TRUE(arranged.ok()) << arranged.status();
  ASSERT_TRUE(trainer->LoadState(*arranged, Trainer::StepCount::kKeep).ok());
  absl::StatusOr<checkpoint::StateDict> read_back = trainer->ExportState();
  ASSERT_TRUE(read_back.ok()) << read_back.status();
  EXPECT_EQ(StateDiff(*read_back, *arranged), "");
  for (size_t i = 0; i < hf.tensors.size() - 1; ++i) {
    EXPECT_TRUE(read_back->tensors[i].tensor.data == exported->tensors[i].tensor.data)
        << read_back->tensors[i].name;
  }
}

// The step's buffers (the LM head's logits in one chunk among them) stay
// cached from step to step: once warm, a GPT step allocates no tensor.
TEST(GptTraining, AWarmStepAllocatesNothing) {
  for (model::Precision precision : {model::Precision::kBf16, model::Precision::kFp32}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    auto trainer = MakeTrainer(GptConfig(precision));
    ASSERT_TRUE(trainer);
    DataRng rng(8);
    ASSERT_TRUE(trainer->Step(RuleBatch(4, 16, 32, rng)).ok());
    const int64_t allocations = trainer->backend().AllocationCount();
    const int64_t in_use = trainer->backend().BytesInUse();
    for (int step = 0; step < 3; ++step) {
      absl::StatusOr<StepReport> r = trainer->Step(RuleBatch(4, 16, 32, rng));
      ASSERT_TRUE(r.ok()) << r.status();
    }
    EXPECT_EQ(trainer->backend().AllocationCount(), allocations);
    EXPECT_EQ(trainer->backend().BytesInUse(), in_use);
  }
}

}  // namespace
}  // namespace ampd::engine
