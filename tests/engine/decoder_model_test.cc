// The Llama/Qwen2/Qwen3 decoder on the CPU backend against real references:
// its fp32 loss vs a float64 re-implementation written here from Hugging
// Face's definition (RMSNorm, rotate-half RoPE, grouped K/V heads, SwiGLU;
// tied and untied heads, both bias families, Qwen3's per-head q/k norm), its gradients vs central
// differences of that float64 loss for a sample of every parameter,
// gradients accumulated over micro-batches, the initialisation, the
// workspace's byte count, Hugging Face state-dict names, fp16 / bf16
// training through the Trainer with the loss scaler at work, and LoRA jobs:
// the frozen base held once in the working dtype, only the adapters
// training, the adapter and merged views, and loading the frozen base.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine_test_util.h"
#include "kernels/float16.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using namespace ampd::engine::testing;

// A tiny decoder: Qwen2-style (grouped K/V heads, q/k/v biases, untied)
// unless the caller changes it.
model::ModelSpec TinyDecoder(int64_t vocab = 11, int64_t hidden = 16, int64_t heads = 4,
                             int64_t kv_heads = 2, int64_t layers = 2) {
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::DecoderSpec d;
  d.vocab_size = vocab;
  d.hidden_size = hidden;
  d.intermediate_size = 24;
  d.num_hidden_layers = layers;
  d.num_attention_heads = heads;
  d.num_key_value_heads = kv_heads;
  d.max_position_embeddings = 16;
  d.rope_theta = 1000.0f;
  d.rms_norm_eps = 1e-5f;
  d.qkv_bias = true;
  spec.kind = d;
  return spec;
}

// Every module a LoRA spec may target.
const std::vector<std::string> kAllModules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};

using Weights = std::map<std::string, std::vector<double>>;

Weights ReadWeights(kernels::Backend& b, const model::Network& net) {
  Weights w;
  for (const model::Parameter& p : net.params()) {
    std::vector<float> v(static_cast<size_t>(p.master.numel()));
    EXPECT_TRUE(b.CopyToHost(p.master, v.data(), v.size() * 4).ok());
    w[p.name] = std::vector<double>(v.begin(), v.end());
  }
  return w;
}

// Moves every master off its init (RMSNorm's 1 and zero biases would hide
// a swapped gradient).
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

// y (rows, out) = x (rows, in) W^T + b, W (out, in) as Hugging Face's Linear.
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<double>& w, int64_t out,
                           const std::vector<double>* bias = nullptr) {
  std::vector<double> y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias ? (*bias)[static_cast<size_t>(o)] : 0.0;
      for (int64_t k = 0; k < in; ++k) {
        acc += x[static_cast<size_t>(r * in + k)] * w[static_cast<size_t>(o * in + k)];
      }
      y[static_cast<size_t>(r * out + o)] = acc;
    }
  }
  return y;
}

std::vector<double> RmsNorm(const std::vector<double>& x, int64_t c, const std::vector<double>& w,
                            double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / static_cast<size_t>(c); ++r) {
    double sq = 0;
    for (int64_t i = 0; i < c; ++i) sq += x[r * c + i] * x[r * c + i];
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(c) + eps);
    for (int64_t i = 0; i < c; ++i) y[r * c + i] = x[r * c + i] * rstd * w[static_cast<size_t>(i)];
  }
  return y;
}

// The decoder's loss in float64 from Hugging Face's LlamaForCausalLM /
// Qwen2ForCausalLM / Qwen3ForCausalLM forward: mean cross-entropy over
// targets other than -100.
double ReferenceLoss(const model::ModelSpec& spec, const Weights& w,
                     const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                     int64_t batch, int64_t seq) {
  const model::DecoderSpec& s = *spec.decoder();
  const int64_t c = s.hidden_size, n = batch * seq, h_q = s.num_attention_heads;
  const int64_t h_kv = s.num_key_value_heads, d = model::DecoderHeadDim(s);
  const int64_t q_w = h_q * d, kv_w = h_kv * d, inter = s.intermediate_size;
  const double eps = s.rms_norm_eps;
  auto at = [&](const std::string& name) -> const std::vector<double>& { return w.at(name); };
  auto maybe = [&](const std::string& name) -> const std::vector<double>* {
    auto it = w.find(name);
    return it == w.end() ? nullptr : &it->second;
  };
  std::vector<double> x(static_cast<size_t>(n * c));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < c; ++i) {
      x[r * c + i] = at("model.embed_tokens.weight")[ids[static_cast<size_t>(r)] * c + i];
    }
  }
  // inv_freq as Hugging Face computes it (fp32), the rotation in float64.
  std::vector<double> inv_freq;
  for (int64_t i = 0; i < d; i += 2) {
    inv_freq.push_back(1.0f /
                       std::pow(s.rope_theta, static_cast<float>(i) / static_cast<float>(d)));
  }
  auto rope = [&](std::vector<double>& t, int64_t width, int64_t heads) {
    for (int64_t r = 0; r < n; ++r) {
      const double pos = static_cast<double>(r % seq);
      for (int64_t h = 0; h < heads; ++h) {
        double* v = &t[static_cast<size_t>(r * width + h * d)];
        for (int64_t i = 0; i < d / 2; ++i) {
          const double angle =
              static_cast<double>(static_cast<float>(pos) * static_cast<float>(inv_freq[i]));
          const double a = v[i], b2 = v[i + d / 2];
          v[i] = a * std::cos(angle) - b2 * std::sin(angle);
          v[i + d / 2] = b2 * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  };
  for (int64_t l = 0; l < s.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::vector<double> a = RmsNorm(x, c, at(p + "input_layernorm.weight"), eps);
    std::vector<double> q =
        Linear(a, n, c, at(p + "self_attn.q_proj.weight"), q_w, maybe(p + "self_attn.q_proj.bias"));
    std::vector<double> k = Linear(a, n, c, at(p + "self_attn.k_proj.weight"), kv_w,
                                   maybe(p + "self_attn.k_proj.bias"));
    const std::vector<double> v = Linear(a, n, c, at(p + "self_attn.v_proj.weight"), kv_w,
                                         maybe(p + "self_attn.v_proj.bias"));
    // Qwen3: q_norm(q_proj(a).view(..., D)): every (row, head) a row of D.
    if (const std::vector<double>* q_norm = maybe(p + "self_attn.q_norm.weight")) {
      q = RmsNorm(q, d, *q_norm, eps);
      k = RmsNorm(k, d, at(p + "self_attn.k_norm.weight"), eps);
    }
    rope(q, q_w, h_q);
    rope(k, kv_w, h_kv);
    std::vector<double> y(static_cast<size_t>(n * q_w), 0.0);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < h_q; ++h) {
        const int64_t g = h / (h_q / h_kv);  // repeat_kv
        for (int64_t t = 0; t < seq; ++t) {
          std::vector<double> sc(static_cast<size_t>(t + 1));
          double mx = -1e300;
          for (int64_t u = 0; u <= t; ++u) {
            double dot = 0;
            for (int64_t i = 0; i < d; ++i) {
              dot += q[(b * seq + t) * q_w + h * d + i] * k[(b * seq + u) * kv_w + g * d + i];
            }
            sc[u] = dot / std::sqrt(static_cast<double>(d));
            mx = std::max(mx, sc[u]);
          }
          double z = 0;
          for (double& e : sc) z += (e = std::exp(e - mx));
          for (int64_t i = 0; i < d; ++i) {
            double acc = 0;
            for (int64_t u = 0; u <= t; ++u) acc += sc[u] / z * v[(b * seq + u) * kv_w + g * d + i];
            y[(b * seq + t) * q_w + h * d + i] = acc;
          }
        }
      }
    }
    const std::vector<double> o =
        Linear(y, n, q_w, at(p + "self_attn.o_proj.weight"), c, maybe(p + "self_attn.o_proj.bias"));
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    const std::vector<double> m = RmsNorm(x, c, at(p + "post_attention_layernorm.weight"), eps);
    const std::vector<double> gate = Linear(m, n, c, at(p + "mlp.gate_proj.weight"), inter);
    std::vector<double> up = Linear(m, n, c, at(p + "mlp.up_proj.weight"), inter);
    for (size_t i = 0; i < up.size(); ++i) up[i] *= gate[i] / (1.0 + std::exp(-gate[i]));
    const std::vector<double> down = Linear(up, n, inter, at(p + "mlp.down_proj.weight"), c);
    for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  const std::vector<double> hidden = RmsNorm(x, c, at("model.norm.weight"), eps);
  const std::vector<double>& head =
      s.tie_word_embeddings ? at("model.embed_tokens.weight") : at("lm_head.weight");
  const std::vector<double> logits = Linear(hidden, n, c, head, s.vocab_size);
  double total = 0;
  int64_t kept = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int32_t target = targets[static_cast<size_t>(r)];
    if (target == -100) continue;
    const double* row = &logits[static_cast<size_t>(r * s.vocab_size)];
    const double mx = *std::max_element(row, row + s.vocab_size);
    double z = 0;
    for (int64_t v = 0; v < s.vocab_size; ++v) z += std::exp(row[v] - mx);
    total += mx + std::log(z) - row[target];
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
    out.targets.push_back(i % 3 == 2 ? -100 : rng.Index(static_cast<int32_t>(vocab)));
  }
  return out;
}

class DecoderNet {
 public:
  DecoderNet(const model::ModelSpec& spec, model::Precision precision, uint64_t seed,
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
  absl::StatusOr<float> Loss(float grad_scale = 1.0f) {
    AMPD_RETURN_IF_ERROR(net_->Forward(*ws_));
    AMPD_RETURN_IF_ERROR(net_->Loss(*ws_, grad_scale, loss_));
    float l = 0;
    AMPD_RETURN_IF_ERROR(backend_->CopyToHost(loss_, &l, 4));
    return l;
  }
  absl::Status Backward(bool first = true) { return net_->Backward(*ws_, first); }
  model::Workspace& workspace() { return *ws_; }

  std::map<std::string, std::vector<float>> Grads() {
    std::map<std::string, std::vector<float>> grads;
    for (model::Parameter& p : net_->params()) {
      std::vector<float> g(static_cast<size_t>(p.master.numel()));
      EXPECT_TRUE(backend_->CopyToHost(p.grad, g.data(), g.size() * 4).ok());
      grads[p.name] = std::move(g);
    }
    return grads;
  }

 private:
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Network> net_;
  model::Workspace* ws_ = nullptr;
  kernels::Tensor loss_;
};

// A Qwen3-style decoder: per-head q/k norm, grouped K/V heads, heads wider
// than hidden / heads (6, not 4), no biases, untied.
model::ModelSpec TinyQwen3() {
  model::ModelSpec spec = TinyDecoder(11, 16, 4, 2, 2);
  spec.decoder()->qkv_bias = false;
  spec.decoder()->qk_norm = true;
  spec.decoder()->head_dim = 6;
  return spec;
}

// The families the conformance tests cover.
std::vector<std::pair<std::string, model::ModelSpec>> Families() {
  model::ModelSpec qwen2 = TinyDecoder();
  model::ModelSpec llama = TinyDecoder(11, 16, 2, 2, 2);
  llama.decoder()->qkv_bias = true;
  llama.decoder()->o_bias = true;
  llama.decoder()->head_dim = 6;  // wider heads than hidden / heads
  model::ModelSpec tied = TinyDecoder(11, 16, 4, 1, 1);
  tied.decoder()->qkv_bias = false;
  tied.decoder()->tie_word_embeddings = true;
  tied.loss_multiplier = 1.5f;
  return {{"qwen2", qwen2}, {"llama", llama}, {"tied", tied}, {"qwen3", TinyQwen3()}};
}

TEST(DecoderForward, Fp32LossMatchesFloat64Reference) {
  for (const auto& [name, spec] : Families()) {
    SCOPED_TRACE(name);
    DecoderNet m(spec, model::Precision::kFp32, 5);
    Jitter(m.backend(), m.net(), 17, 0.1f);
    const Batch data = RandomBatch(3, 7, spec.decoder()->vocab_size, 1);
    ASSERT_TRUE(m.Load(data).ok());
    absl::StatusOr<float> loss = m.Loss();
    ASSERT_TRUE(loss.ok()) << loss.status();
    const double want = ReferenceLoss(spec, ReadWeights(m.backend(), m.net()), data.ids,
                                      data.targets, data.batch, data.seq);
    EXPECT_NEAR(*loss, want, 2e-6 * std::fabs(want) + 1e-6) << "want " << want;
  }
}

TEST(DecoderBackward, GradientsMatchCentralDifferencesOfTheFloat64Loss) {
  for (const auto& [name, spec] : Families()) {
    SCOPED_TRACE(name);
    DecoderNet m(spec, model::Precision::kFp32, 9);
    Jitter(m.backend(), m.net(), 23, 0.3f);
    const Batch data = RandomBatch(2, 5, spec.decoder()->vocab_size, 4);
    ASSERT_TRUE(m.Load(data).ok());
    ASSERT_TRUE(m.net().ZeroGrads().ok());
    ASSERT_TRUE(m.Loss().ok());
    ExpectGradsReadyOnceAndFinal(m.backend(), m.net(), m.workspace());
    const std::map<std::string, std::vector<float>> grads = m.Grads();
    Weights w = ReadWeights(m.backend(), m.net());
    DataRng pick(31);
    int checked = 0;
    for (const model::Parameter& p : m.net().params()) {
      std::vector<double>& values = w[p.name];
      for (int k = 0; k < 4; ++k) {
        const auto i = static_cast<size_t>(pick.Index(static_cast<int32_t>(values.size())));
        const double h = 1e-4;
        const double saved = values[i];
        values[i] = saved + h;
        const double lp = ReferenceLoss(spec, w, data.ids, data.targets, data.batch, data.seq);
        values[i] = saved - h;
        const double lm = ReferenceLoss(spec, w, data.ids, data.targets, data.batch, data.seq);
        values[i] = saved;
        const double fd = (lp - lm) / (2 * h);
        EXPECT_NEAR(grads.at(p.name)[i], fd, 1e-4 + 1e-3 * std::fabs(fd))
            << p.name << "[" << i << "]";
        ++checked;
      }
    }
    EXPECT_EQ(checked, 4 * static_cast<int>(m.net().params().size()));
  }
}

// Two micro-batches accumulate what each gives alone: the stacked q|k|v
// gradient starts from the parameters' on the second.
TEST(DecoderBackward, MicroBatchesAccumulate) {
  for (const model::ModelSpec& spec : {TinyDecoder(), TinyQwen3()}) {
    DecoderNet m(spec, model::Precision::kFp32, 3);
    Jitter(m.backend(), m.net(), 5, 0.2f);
    const Batch one = RandomBatch(2, 6, 11, 7);
    const Batch two = RandomBatch(2, 6, 11, 8);
    std::map<std::string, std::vector<float>> alone[2];
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(m.net().ZeroGrads().ok());
      ASSERT_TRUE(m.Load(i == 0 ? one : two).ok());
      ASSERT_TRUE(m.Loss().ok());
      ASSERT_TRUE(m.Backward(true).ok());
      alone[i] = m.Grads();
    }
    ASSERT_TRUE(m.net().ZeroGrads().ok());
    ASSERT_TRUE(m.Load(one).ok());
    ASSERT_TRUE(m.Loss().ok());
    ASSERT_TRUE(m.Backward(true).ok());
    ASSERT_TRUE(m.Load(two).ok());
    ASSERT_TRUE(m.Loss().ok());
    ASSERT_TRUE(m.Backward(false).ok());
    for (const auto& [name, g] : m.Grads()) {
      for (size_t i = 0; i < g.size(); ++i) {
        const double want = static_cast<double>(alone[0][name][i]) + alone[1][name][i];
        ASSERT_NEAR(g[i], want, 1e-6 + 1e-5 * std::fabs(want)) << name << "[" << i << "]";
      }
    }
  }
}

TEST(DecoderInit, HuggingFaceDistributionsAndNamesFromTheSeed) {
  model::ModelSpec spec = TinyDecoder(256, 64, 4, 2, 3);
  spec.decoder()->intermediate_size = 128;
  spec.decoder()->initializer_range = 0.05f;
  DecoderNet a(spec, model::Precision::kBf16, 42);
  DecoderNet same(spec, model::Precision::kBf16, 42);
  const Weights w = ReadWeights(a.backend(), a.net());
  EXPECT_EQ(w, ReadWeights(same.backend(), same.net()));
  // Per block: 2 norms, q/k/v weights and biases, o, gate, up, down.
  ASSERT_EQ(a.net().params().size(), 1u + 3u * 12u + 2u);
  EXPECT_EQ(a.net().params()[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(a.net().params()[1].name, "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(a.net().params()[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(a.net().params()[3].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(a.net().params()[8].name, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(a.net().params().back().name, "lm_head.weight");
  EXPECT_EQ(a.net().parameter_count(), model::ParameterCount(spec));
  EXPECT_EQ(a.net().params()[4].master.shape(), (kernels::Shape{32, 64}));  // k_proj: 2 x 16
  auto stddev = [](const std::vector<double>& v) {
    double sq = 0;
    for (double x : v) sq += x * x;
    return std::sqrt(sq / static_cast<double>(v.size()));
  };
  for (const char* name : {"model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight",
                           "model.layers.2.mlp.down_proj.weight", "lm_head.weight"}) {
    EXPECT_NEAR(stddev(w.at(name)), 0.05, 0.003) << name;
  }
  for (double x : w.at("model.layers.0.post_attention_layernorm.weight")) EXPECT_EQ(x, 1.0);
  for (double x : w.at("model.layers.0.self_attn.k_proj.bias")) EXPECT_EQ(x, 0.0);
  EXPECT_NE(w.at("model.layers.0.mlp.gate_proj.weight"), w.at("model.layers.0.mlp.up_proj.weight"));
  // Scale groups: the embedding in 0, block l in l, the norm and head last.
  const std::vector<int> groups = a.net().ParamScaleGroups();
  EXPECT_EQ(groups.front(), 0);
  EXPECT_EQ(groups[1], 0);
  EXPECT_EQ(groups[13], 1);
  EXPECT_EQ(groups.back(), 2);
}

// Qwen3's q_norm and k_norm: (head_dim) each after o_proj in every block,
// initialised to 1, in their block's scale group, counted, and only with
// qk_norm.
TEST(DecoderInit, QkNormWeightsFollowOProjInTheirBlock) {
  model::ModelSpec spec = TinyQwen3();
  DecoderNet a(spec, model::Precision::kBf16, 42);
  const Weights w = ReadWeights(a.backend(), a.net());
  // Per block: 2 norms, q/k/v, o, q_norm, k_norm, gate, up, down.
  ASSERT_EQ(a.net().params().size(), 1u + 2u * 11u + 2u);
  EXPECT_EQ(a.net().params()[5].name, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(a.net().params()[6].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(a.net().params()[7].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(a.net().params()[8].name, "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(a.net().params()[6].master.shape(), (kernels::Shape{6}));
  EXPECT_EQ(a.net().params()[18].name, "model.layers.1.self_attn.k_norm.weight");
  EXPECT_EQ(a.net().parameter_count(), model::ParameterCount(spec));
  spec.decoder()->qk_norm = false;
  EXPECT_EQ(a.net().parameter_count(), model::ParameterCount(spec) + 2 * 2 * 6);
  for (const char* name :
       {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"}) {
    for (double x : w.at(name)) EXPECT_EQ(x, 1.0) << name;
  }
  const std::vector<int> groups = a.net().ParamScaleGroups();
  EXPECT_EQ(groups[6], 0);
  EXPECT_EQ(groups[7], 0);
  EXPECT_EQ(groups[17], 1);
  EXPECT_EQ(groups[18], 1);
}

TEST(DecoderSpec, ValidationNamesTheField) {
  auto error = [](const model::ModelSpec& spec) {
    return std::string(model::ValidateModelSpec(spec).message());
  };
  EXPECT_TRUE(model::ValidateModelSpec(TinyDecoder()).ok());
  model::ModelSpec s = TinyDecoder();
  s.decoder()->num_key_value_heads = 3;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.num_key_value_heads")) << error(s);
  s = TinyDecoder();
  s.decoder()->head_dim = 5;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.head_dim")) << error(s);
  s = TinyDecoder(11, 18, 4, 2);
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.num_attention_heads")) << error(s);
  s = TinyDecoder();
  s.decoder()->rope_theta = std::nanf("");
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.rope_theta")) << error(s);
  s = TinyDecoder();
  s.decoder()->intermediate_size = 0;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.intermediate_size")) << error(s);
  s = TinyDecoder();
  s.decoder()->vocab_size = int64_t{1} << 60;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.vocab_size")) << error(s);
  s = TinyDecoder();
  s.decoder()->hidden_size = int64_t{1} << 53;
  s.decoder()->head_dim = 2;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.hidden_size")) << error(s);
  s = TinyDecoder();
  s.loss = model::LossKind::kMse;
  EXPECT_TRUE(absl::StartsWith(error(s), "loss")) << error(s);
  s = TinyDecoder();
  s.decoder()->lora = model::LoraSpec{2, 4.0f, {"q_proj", "up_proj", "k_proj"}};
  EXPECT_TRUE(model::ValidateModelSpec(s).ok()) << error(s);
  s.decoder()->lora->rank = 100;
  EXPECT_TRUE(absl::StartsWith(error(s), "decoder.lora.rank")) << error(s);
}

TEST(TransformerWorkspace, BytesBoundTheAllocationAndOverflowIsRefused) {
  model::ModelSpec some_adapters = TinyDecoder();
  some_adapters.decoder()->lora = model::LoraSpec{2, 4.0f, {"k_proj", "o_proj", "down_proj"}};
  model::ModelSpec all_adapters = TinyDecoder(11, 16, 4, 4, 2);
  all_adapters.decoder()->lora = model::LoraSpec{3, 3.0f, kAllModules};
  model::ModelSpec qwen3_adapters = TinyQwen3();
  qwen3_adapters.decoder()->lora = model::LoraSpec{2, 4.0f, {"q_proj", "k_proj"}};
  for (const model::ModelSpec& spec : {TinyDecoder(), TinyDecoder(11, 16, 4, 4, 2), some_adapters,
                                       all_adapters, TinyQwen3(), qwen3_adapters}) {
    DecoderNet m(spec, model::Precision::kBf16, 1, /*lm_head_chunk_bytes=*/7 * 11 * 2);
    const int64_t before = m.backend().BytesInUse();
    ASSERT_TRUE(m.Load(RandomBatch(3, 10, 11, 5)).ok());
    const int64_t used = m.backend().BytesInUse() - before;
    absl::StatusOr<int64_t> bytes =
        model::TransformerWorkspaceBytes(spec, model::Precision::kBf16, {3, 10}, 7 * 11 * 2);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    // ids and targets are I32 here, counted as I64.
    // The token loss's five (N) F32 buffers (three inputs, the log-probs,
    // the per-token losses) are counted and allocated only by a step that
    // uses them: 5 x 30 x 4 more.
    EXPECT_EQ(*bytes - used, 2 * 30 * 4 + 5 * 30 * 4);
    EXPECT_EQ(m.net().cached_workspace_bytes(), *bytes);
  }
  const model::ModelSpec spec = TinyDecoder();
  EXPECT_EQ(model::WorkspaceBytes(spec, model::Precision::kBf16, {3, 17}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status huge =
      model::WorkspaceBytes(spec, model::Precision::kBf16, {int64_t{1} << 50, 16}).status();
  EXPECT_TRUE(absl::StrContains(huge.message(), "more than 2^63 bytes")) << huge;
}

// A Hugging Face file (a rotary buffer the model ignores, a tied head
// equal to the embedding) loads as weights alone; a head that differs is
// refused.
TEST(DecoderState, HuggingFaceNamesLoad) {
  model::ModelSpec spec = TinyDecoder();
  spec.decoder()->tie_word_embeddings = true;
  JobConfig config = DefaultJobConfig(model::Precision::kFp32);
  config.model = spec;
  std::unique_ptr<Trainer> source = MakeTrainer(config);
  config.seed = 9;
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(source && trainer);
  absl::StatusOr<checkpoint::StateDict> exported = source->ExportState();
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->metadata.at("format"), "pt");
  checkpoint::StateDict hf;
  for (const codec::NamedTensor& t : exported->tensors) {
    if (!absl::StartsWith(t.name, "optimizer.")) hf.tensors.push_back(t);
  }
  hf.tensors.push_back({"lm_head.weight", hf.tensors.front().tensor});
  hf.tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", F32({4}, {1, 2, 3, 4})});
  ASSERT_TRUE(trainer->LoadState(hf, Trainer::StepCount::kKeep).ok());
  absl::StatusOr<checkpoint::StateDict> read_back = trainer->ExportState();
  ASSERT_TRUE(read_back.ok());
  for (size_t i = 0; i < hf.tensors.size() - 2; ++i) {
    EXPECT_TRUE(read_back->tensors[i].tensor.data == hf.tensors[i].tensor.data)
        << hf.tensors[i].name;
  }
  hf.tensors[hf.tensors.size() - 2].tensor.data[0] ^= 1;
  const absl::Status differs = trainer->LoadState(hf, Trainer::StepCount::kKeep);
  EXPECT_TRUE(absl::StartsWith(differs.message(), "lm_head.weight: differs")) << differs;
}

// A sharded checkpoint loads file by file as partial loads: each file
// replaces the weights it holds, and the optimizer's moments and count, the
// scaler and the job's count stay as they were; a complete load still
// refuses a missing weight, and a partial one unknown names, wrong shapes
// and optimizer state.
TEST(DecoderState, ShardsLoadFileByFileAndLeaveTheOptimizerAlone) {
  JobConfig config = DefaultJobConfig(model::Precision::kFp32);
  config.model = TinyDecoder();
  std::unique_ptr<Trainer> source = MakeTrainer(config);
  config.seed = 9;
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(source && trainer);
  StepInput input;
  const Batch data = RandomBatch(2, 6, 11, 1);
  input.micro_batches.push_back({I32({2, 6}, data.ids), I32({2, 6}, data.targets)});
  ASSERT_TRUE(trainer->Step(input).ok());
  absl::StatusOr<checkpoint::StateDict> before = trainer->ExportState();
  absl::StatusOr<checkpoint::StateDict> weights = source->ExportState();
  ASSERT_TRUE(before.ok() && weights.ok());
  checkpoint::StateDict shards[2];
  size_t count = 0;
  for (const codec::NamedTensor& t : weights->tensors) {
    if (absl::StartsWith(t.name, "optimizer.")) continue;
    shards[count++ % 2].tensors.push_back(t);
  }
  shards[0].metadata["format"] = "pt";
  using Coverage = Trainer::Coverage;
  const Trainer::StepCount keep = Trainer::StepCount::kKeep;
  const absl::Status whole = trainer->LoadState(shards[0], keep);
  EXPECT_TRUE(absl::StrContains(whole.message(), ": missing")) << whole;
  ASSERT_TRUE(trainer->LoadState(shards[0], keep, Coverage::kPartial).ok());
  absl::StatusOr<checkpoint::StateDict> half = trainer->ExportState();
  ASSERT_TRUE(half.ok());
  // The ArrangeForLoad of the second shard is what loading it reads back.
  absl::StatusOr<checkpoint::StateDict> arranged =
      trainer->ArrangeForLoad(shards[1], keep, Coverage::kPartial);
  ASSERT_TRUE(arranged.ok()) << arranged.status();
  ASSERT_TRUE(trainer->LoadState(shards[1], keep, Coverage::kPartial).ok());
  absl::StatusOr<checkpoint::StateDict> after = trainer->ExportState();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(StateDiff(*after, *arranged), "");
  std::map<std::string, const codec::HostTensor*> by_name;
  for (const codec::NamedTensor& t : weights->tensors) by_name[t.name] = &t.tensor;
  for (size_t i = 0; i < after->tensors.size(); ++i) {
    const codec::NamedTensor& t = after->tensors[i];
    const codec::HostTensor& want =
        absl::StartsWith(t.name, "optimizer.") ? before->tensors[i].tensor : *by_name.at(t.name);
    EXPECT_TRUE(t.tensor.data == want.data) << t.name;
    // Half-way, the second shard's weights were still the job's own.
    if (!absl::StartsWith(t.name, "optimizer.") && half->tensors[i].tensor.data != want.data) {
      EXPECT_TRUE(half->tensors[i].tensor.data == before->tensors[i].tensor.data) << t.name;
    }
  }
  EXPECT_EQ(after->metadata, before->metadata);
  EXPECT_EQ(trainer->steps_run(), 1);

  checkpoint::StateDict bad = shards[1];
  bad.tensors.push_back({"model.layers.9.mlp.up_proj.weight", F32({1}, {0.0f})});
  EXPECT_TRUE(absl::StrContains(trainer->LoadState(bad, keep, Coverage::kPartial).message(),
                                "not a tensor of this job's model"));
  bad = shards[1];
  bad.tensors[0].tensor = F32({1}, {0.0f});
  EXPECT_TRUE(absl::StrContains(trainer->LoadState(bad, keep, Coverage::kPartial).message(),
                                "expected F32"));
  bad = shards[1];
  bad.tensors.push_back(before->tensors.back());
  EXPECT_TRUE(absl::StrContains(trainer->LoadState(bad, keep, Coverage::kPartial).message(),
                                "replaces model weights only"));
  bad = shards[1];
  bad.metadata["scaler.scale"] = "2";
  EXPECT_TRUE(absl::StrContains(trainer->LoadState(bad, keep, Coverage::kPartial).message(),
                                "replaces model weights only"));
  bad = checkpoint::StateDict();
  bad.tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", F32({1}, {0.0f})});
  EXPECT_TRUE(absl::StrContains(trainer->LoadState(bad, keep, Coverage::kPartial).message(),
                                "none of the model's weights"));
  absl::StatusOr<checkpoint::StateDict> unchanged = trainer->ExportState();
  ASSERT_TRUE(unchanged.ok());
  EXPECT_EQ(StateDiff(*unchanged, *after), "");
}

// Sequences of a fixed rule (next = (3 t + 1) mod V): the loss can fall far.
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

TEST(DecoderTraining, Bf16AndFp16LossFallsWithTheScalerAtWork) {
  for (model::Precision precision : {model::Precision::kBf16, model::Precision::kFp16}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    JobConfig config = DefaultJobConfig(precision);
    config.model = TinyDecoder(32, 32, 4, 2, 2);
    config.model.decoder()->intermediate_size = 64;
    config.optimizer.adam.lr = 3e-3f;
    config.seed = 3;
    if (precision == model::Precision::kFp16) config.scaler.init_scale = 0x1p40;
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
    }
  }
}

// The step's buffers (the stacked q|k|v matrices among them) stay cached:
// once warm, a decoder step allocates no tensor.
TEST(DecoderTraining, AWarmStepAllocatesNothing) {
  for (const bool lora : {false, true}) {
    for (model::Precision precision : {model::Precision::kBf16, model::Precision::kFp32}) {
      SCOPED_TRACE(absl::StrCat(model::PrecisionName(precision), lora ? " LoRA" : ""));
      JobConfig config = DefaultJobConfig(precision);
      config.model = TinyDecoder(32, 32, 4, 2, 2);
      if (lora) config.model.decoder()->lora = model::LoraSpec{4, 8.0f, kAllModules};
      auto trainer = MakeTrainer(config);
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
}

// ---- LoRA --------------------------------------------------------------------

JobConfig LoraJob(model::Precision precision, std::vector<std::string> targets, int64_t rank = 4) {
  JobConfig config = DefaultJobConfig(precision);
  config.model = TinyDecoder(32, 32, 4, 2, 2);
  config.model.decoder()->intermediate_size = 64;
  config.model.decoder()->lora = model::LoraSpec{rank, 2.0f * static_cast<float>(rank), targets};
  config.optimizer.adam.lr = 1e-2f;
  config.seed = 3;
  return config;
}

bool IsAdapter(const std::string& name) {
  return absl::StrContains(name, ".lora_A.") || absl::StrContains(name, ".lora_B.");
}

// The base is frozen and held once, in the working dtype; only the
// adapters have masters, gradients and optimizer state, and the estimate
// counts exactly that.
TEST(DecoderLora, FrozenBaseIsHeldInTheWorkingDtypeOnly) {
  const JobConfig config = LoraJob(model::Precision::kFp16, {"q_proj", "v_proj", "down_proj"});
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer);
  JobConfig full = config;
  full.model.decoder()->lora.reset();
  const int64_t base = model::ParameterCount(full.model);
  const int64_t adapters = model::LoraParameterCount(*config.model.decoder());
  EXPECT_EQ(adapters, 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32)));
  EXPECT_EQ(trainer->parameter_count(), base + adapters);
  EXPECT_EQ(EstimateJobBytes(config), 2 * base + (4 + 2 + 2 + 8) * adapters);
  absl::StatusOr<checkpoint::StateDict> state = trainer->ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  int64_t adapter_tensors = 0, moments = 0;
  for (const codec::NamedTensor& t : state->tensors) {
    if (absl::StartsWith(t.name, "optimizer.")) {
      EXPECT_TRUE(IsAdapter(t.name)) << t.name;
      ++moments;
    } else if (IsAdapter(t.name)) {
      EXPECT_EQ(t.tensor.dtype, DType::kF32) << t.name;
      ++adapter_tensors;
    } else {
      EXPECT_EQ(t.tensor.dtype, DType::kF16) << t.name;
    }
  }
  EXPECT_EQ(adapter_tensors, 2 * 2 * 3);
  EXPECT_EQ(moments, 2 * adapter_tensors);  // exp_avg and exp_avg_sq
  // The base is the full job's of the same seed, rounded once to fp16.
  std::unique_ptr<Trainer> full_trainer = MakeTrainer(full);
  ASSERT_TRUE(full_trainer);
  absl::StatusOr<checkpoint::StateDict> full_state = full_trainer->ExportState();
  ASSERT_TRUE(full_state.ok());
  const HostTensor& q = state->tensors[2].tensor;  // model.layers.0.self_attn.q_proj.weight
  const HostTensor& q_full = full_state->tensors[2].tensor;
  ASSERT_EQ(state->tensors[2].name, "model.layers.0.self_attn.q_proj.weight");
  for (int64_t i = 0; i < q.shape[0] * q.shape[1]; ++i) {
    float f = 0.0f;
    uint16_t h = 0;
    std::memcpy(&f, q_full.data.data() + 4 * i, 4);
    std::memcpy(&h, q.data.data() + 2 * i, 2);
    ASSERT_EQ(h, kernels::FloatToHalfBits(f)) << i;
  }
}

// Every target set trains in each precision: the adapters move, the base
// never does, and the loss falls (the fp16 scaler at work).
TEST(DecoderLora, OnlyTheAdaptersTrainAndTheLossFalls) {
  const std::vector<std::vector<std::string>> target_sets = {
      {"q_proj", "k_proj", "v_proj", "o_proj"}, {"k_proj", "up_proj"}, kAllModules};
  for (model::Precision precision :
       {model::Precision::kFp32, model::Precision::kBf16, model::Precision::kFp16}) {
    for (const std::vector<std::string>& targets : target_sets) {
      SCOPED_TRACE(absl::StrCat(model::PrecisionName(precision), " ", targets.size(), " targets"));
      JobConfig config = LoraJob(precision, targets, 8);
      // The head is frozen: drawn with std 0.02 its logits stay within about
      // +-0.6 whatever the adapters do, and the loss cannot fall below ~2.8.
      // A wider base lets the adapters show what they learn.
      config.model.decoder()->initializer_range = 0.3f;
      // fp16: a scale that overflows at first, so the scaler backs off.
      int skipped = 0;
      if (precision == model::Precision::kFp16) config.scaler.init_scale = 0x1p24;
      std::unique_ptr<Trainer> trainer = MakeTrainer(config);
      ASSERT_TRUE(trainer);
      absl::StatusOr<checkpoint::StateDict> before = trainer->ExportState();
      ASSERT_TRUE(before.ok());
      DataRng rng(8);
      std::vector<float> losses;
      for (int step = 0; step < 150; ++step) {
        absl::StatusOr<StepReport> r = trainer->Step(RuleBatch(4, 16, 32, rng));
        ASSERT_TRUE(r.ok()) << r.status();
        if (r->scaler.skipped) {
          ++skipped;
        } else {
          losses.push_back(r->loss);
        }
      }
      ASSERT_GE(losses.size(), 120u);
      double first = 0, last = 0;
      for (size_t i = 0; i < 5; ++i) first += losses[i] / 5.0;
      for (size_t i = losses.size() - 5; i < losses.size(); ++i) last += losses[i] / 5.0;
      EXPECT_LT(last, 0.7 * first) << first << " -> " << last;
      if (precision == model::Precision::kFp16) {
        EXPECT_GT(skipped, 0);
      }
      absl::StatusOr<checkpoint::StateDict> after = trainer->ExportState();
      ASSERT_TRUE(after.ok());
      ASSERT_EQ(after->tensors.size(), before->tensors.size());
      for (size_t i = 0; i < after->tensors.size(); ++i) {
        const std::string& name = after->tensors[i].name;
        if (absl::StartsWith(name, "optimizer.")) continue;
        const bool moved = after->tensors[i].tensor.data != before->tensors[i].tensor.data;
        EXPECT_EQ(moved, IsAdapter(name)) << name;
      }
    }
  }
}

// The views: the adapter one holds the adapters alone with PEFT's config;
// the merged one is W + (alpha / r) B A in F32, in Hugging Face's names.
TEST(DecoderLora, AdapterAndMergedViews) {
  const JobConfig config = LoraJob(model::Precision::kBf16, {"v_proj", "o_proj", "gate_proj"});
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer);
  DataRng rng(5);
  for (int step = 0; step < 5; ++step) ASSERT_TRUE(trainer->Step(RuleBatch(4, 16, 32, rng)).ok());
  absl::StatusOr<checkpoint::StateDict> full = trainer->ExportState();
  absl::StatusOr<checkpoint::StateDict> adapter = trainer->ExportView(StateView::kAdapter);
  absl::StatusOr<checkpoint::StateDict> merged = trainer->ExportView(StateView::kMerged);
  ASSERT_TRUE(full.ok() && adapter.ok() && merged.ok()) << adapter.status() << merged.status();
  ASSERT_EQ(adapter->tensors.size(), 2u * 2 * 3);
  EXPECT_EQ(adapter->tensors[0].name,
            "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight");
  EXPECT_EQ(adapter->tensors[5].name,
            "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight");
  EXPECT_TRUE(absl::StrContains(adapter->metadata.at("adapter_config"),
                                "\"target_modules\": [\"v_proj\", \"o_proj\", \"gate_proj\"]"))
      << adapter->metadata.at("adapter_config");
  std::map<std::string, const HostTensor*> by_name;
  for (const codec::NamedTensor& t : full->tensors) by_name[t.name] = &t.tensor;
  auto floats = [](const HostTensor& h) {
    std::vector<double> out;
    const size_t size = kernels::SizeOf(h.dtype);
    for (size_t i = 0; i < h.data.size() / size; ++i) {
      if (size == 4) {
        float f = 0.0f;
        std::memcpy(&f, h.data.data() + 4 * i, 4);
        out.push_back(f);
      } else {
        uint16_t b = 0;
        std::memcpy(&b, h.data.data() + 2 * i, 2);
        out.push_back(kernels::Bf16BitsToFloat(b));
      }
    }
    return out;
  };
  int checked = 0;
  for (const codec::NamedTensor& t : merged->tensors) {
    EXPECT_EQ(t.tensor.dtype, DType::kF32) << t.name;
    EXPECT_FALSE(IsAdapter(t.name) || absl::StartsWith(t.name, "optimizer.")) << t.name;
    const std::vector<double> w = floats(*by_name.at(t.name));
    const std::vector<double> got = floats(t.tensor);
    const std::string stem = t.name.substr(0, t.name.size() - std::string(".weight").size());
    auto a = by_name.find("base_model.model." + stem + ".lora_A.weight");
    if (a == by_name.end()) {
      EXPECT_EQ(got, w) << t.name;  // not adapted: the base, widened exactly
      continue;
    }
    const std::vector<double> av = floats(*a->second);
    const std::vector<double> bv =
        floats(*by_name.at("base_model.model." + stem + ".lora_B.weight"));
    const int64_t out = t.tensor.shape[0], in = t.tensor.shape[1], rank = 4;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double sum = 0.0;
        for (int64_t k = 0; k < rank; ++k) sum += bv[o * rank + k] * av[k * in + i];
        const double expected = w[o * in + i] + 2.0 * sum;
        EXPECT_NEAR(got[o * in + i], expected, 1e-6 * (1.0 + std::abs(expected))) << t.name;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 2 * 3);
  // A job without adapters has no adapter view.
  JobConfig plain = config;
  plain.model.decoder()->lora.reset();
  std::unique_ptr<Trainer> full_trainer = MakeTrainer(plain);
  ASSERT_TRUE(full_trainer);
  const absl::Status refused = full_trainer->ExportView(StateView::kAdapter).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "view:")) << refused;
}

// A frozen 16-bit base loads from its own dtype or from F32 (rounded once,
// as a full job's export is), and a value the dtype cannot hold is refused
// by name, leaving the job as it was.
TEST(DecoderLora, FrozenBaseLoadsFromF32RoundedAndRefusesOverflow) {
  JobConfig config = LoraJob(model::Precision::kFp16, {"q_proj"});
  JobConfig full = config;
  full.model.decoder()->lora.reset();
  full.seed = 17;
  std::unique_ptr<Trainer> source = MakeTrainer(full);
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(source && trainer);
  absl::StatusOr<checkpoint::StateDict> weights = source->ExportState();
  ASSERT_TRUE(weights.ok());
  checkpoint::StateDict base;
  for (const codec::NamedTensor& t : weights->tensors) {
    if (!absl::StartsWith(t.name, "optimizer.")) base.tensors.push_back(t);
  }
  const Trainer::StepCount keep = Trainer::StepCount::kKeep;
  ASSERT_TRUE(trainer->LoadState(base, keep, Trainer::Coverage::kPartial).ok());
  absl::StatusOr<checkpoint::StateDict> loaded = trainer->ExportState();
  ASSERT_TRUE(loaded.ok());
  const HostTensor& embed = loaded->tensors[0].tensor;
  ASSERT_EQ(embed.dtype, DType::kF16);
  for (size_t i = 0; i < embed.data.size() / 2; ++i) {
    float f = 0.0f;
    uint16_t h = 0;
    std::memcpy(&f, base.tensors[0].tensor.data.data() + 4 * i, 4);
    std::memcpy(&h, embed.data.data() + 2 * i, 2);
    ASSERT_EQ(h, kernels::FloatToHalfBits(f)) << i;
  }
  float huge = 1e6f;
  std::memcpy(base.tensors[1].tensor.data.data(), &huge, 4);
  const absl::Status overflow = trainer->LoadState(base, keep, Trainer::Coverage::kPartial);
  EXPECT_EQ(overflow.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(overflow.message(), base.tensors[1].name + ": element 0 (1e+06)"))
      << overflow;
  absl::StatusOr<checkpoint::StateDict> unchanged = trainer->ExportState();
  ASSERT_TRUE(unchanged.ok());
  EXPECT_EQ(StateDiff(*unchanged, *loaded), "");
  // Its own export loads back bit for bit (F16 base, F32 adapters).
  ASSERT_TRUE(trainer->LoadState(*loaded).ok());
  absl::StatusOr<checkpoint::StateDict> again = trainer->ExportState();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(StateDiff(*again, *loaded), "");
}

}  // namespace
}  // namespace ampd::engine
