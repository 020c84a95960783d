// The sampler's device ops on every backend this build can create (cpu,
// and cuda:0 where a device is visible; absent backends skip):
// - SampleTokens against the host draw the sampler made before it was an
//   op (copied here verbatim as the reference: float64, Philox uniform per
//   row and step), for temperature 0, 0.7 and 1 with top_k and top_p on and
//   off, in every float dtype, rows with ties, stopped rows; and with each
//   row's own Philox key and stream (SampleParams::keys). The CPU must
//   equal it token for token. CUDA sums the weights in another fixed order
//   (kernels/cuda/sample_tokens.cu), which changes a token only where u
//   lands within a float64 rounding of a cumulative boundary; on these
//   inputs that never happens, so it is held to equality too.
// - SampleTokens' log_kept, the log of the mass a draw kept, against a
//   float64 softmax over the whole row, sorted and cut by top_k and top_p
//   as the contract says: exactly 0 where nothing is cut, at temperature 0
//   and for stopped rows.
// - WriteKvRows against the per-sequence CopyColumns it replaced: every
//   byte of both caches (the untouched rows included), aligned and
//   unaligned widths, I32 and I64 positions.
// - The refusals, with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/philox.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::MakeTensor;
using testing::RandomValues;
using testing::RawBytes;

// ---- the reference: the sampler's host draw, as it was --------------------------
// (But for one rule added since: top_k >= V keeps every token, and so draws
// as top_k 0 does, in id order when nothing else truncates.)
struct DrawInput {
  float temperature = 1.0f;
  int64_t top_k = 0;
  float top_p = 1.0f;
};

int64_t ReferenceDraw(const float* logits, int64_t vocab, const DrawInput& in, double u,
                      std::vector<int64_t>& order, std::vector<double>& weights) {
  if (in.temperature == 0.0f) {
    return std::max_element(logits, logits + vocab) - logits;
  }
  const double inv_t = 1.0 / static_cast<double>(in.temperature);
  if ((in.top_k == 0 || in.top_k >= vocab) && in.top_p >= 1.0f) {
    const double top = static_cast<double>(*std::max_element(logits, logits + vocab)) * inv_t;
    weights.resize(static_cast<size_t>(vocab));
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      weights[static_cast<size_t>(i)] = std::exp(static_cast<double>(logits[i]) * inv_t - top);
      total += weights[static_cast<size_t>(i)];
    }
    const double target = u * total;
    double cumulative = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      cumulative += weights[static_cast<size_t>(i)];
      if (target < cumulative) return i;
    }
    return vocab - 1;
  }
  order.resize(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), int64_t{0});
  auto likelier = [logits](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t keep = in.top_k > 0 ? std::min(in.top_k, vocab) : vocab;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), likelier);
  const double top = static_cast<double>(logits[order[0]]) * inv_t;
  weights.resize(static_cast<size_t>(keep));
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    weights[static_cast<size_t>(i)] =
        std::exp(static_cast<double>(logits[order[static_cast<size_t>(i)]]) * inv_t - top);
    total += weights[static_cast<size_t>(i)];
  }
  int64_t nucleus = keep;
  if (in.top_p < 1.0f) {
    double mass = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      mass += weights[static_cast<size_t>(i)] / total;
      if (mass >= static_cast<double>(in.top_p)) {
        nucleus = i + 1;
        break;
      }
    }
  }
  double in_nucleus = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) in_nucleus += weights[static_cast<size_t>(i)];
  const double target = u * in_nucleus;
  double cumulative = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) {
    cumulative += weights[static_cast<size_t>(i)];
    if (target < cumulative) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(nucleus - 1)];
}

// ---- fixtures ------------------------------------------------------------------------
class SampleOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(GetParam());
    if (!b.ok() && b.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << GetParam() << ": no device (" << b.status().message() << ")";
    }
    ASSERT_TRUE(b.ok()) << GetParam() << ": " << b.status();
    be_ = std::move(*b);
  }
  std::unique_ptr<Backend> be_;
};

// (rows, vocab) logits in dtype: uniform in [-spread, spread], with row 1
// flat (every token tied) and row 2 holding a run of ties at its maximum.
std::vector<double> Logits(std::mt19937_64& rng, DType dtype, int64_t rows, int64_t vocab,
                           double spread) {
  std::vector<double> z =
      RandomValues(rng, dtype, static_cast<size_t>(rows * vocab), -spread, spread);
  if (rows > 1) std::fill(z.begin() + vocab, z.begin() + 2 * vocab, 0.5);
  if (rows > 2) {
    for (int64_t i = 0; i < std::min<int64_t>(vocab, 7); ++i) {
      z[static_cast<size_t>(2 * vocab + i * (vocab / 7))] = spread + 1.0;
    }
  }
  return z;
}

TEST_P(SampleOpsTest, SampleTokensEqualsTheHostDraw) {
  constexpr int64_t kRows = 6;
  // A Qwen2.5-sized vocabulary too (bf16, one spread: its CPU reference
  // sorts 151,936 logits per row and case).
  const int64_t vocabs[] = {1000, 4099, 151936};
  const float temperatures[] = {0.0f, 0.7f, 1.0f};
  struct Truncation {
    int64_t top_k;
    float top_p;
  };
  const Truncation truncations[] = {{0, 1.0f}, {1, 1.0f},  {5, 1.0f},    {0, 0.9f},
                                    {0, 0.3f}, {40, 0.8f}, {5000, 1.0f}, {5000, 0.95f}};
  std::mt19937_64 rng(7);
  std::vector<int64_t> order;
  std::vector<double> weights;
  int draws = 0;
  for (DType dtype : testing::kFloatTypes) {
    for (int64_t vocab : vocabs) {
      // A narrow spread makes the truncated sets and the nucleus wide.
      for (double spread : {3.0, 12.0}) {
        if (vocab > 10000 && (dtype != DType::kBF16 || spread != 3.0)) continue;
        const std::vector<double> z = Logits(rng, dtype, kRows, vocab, spread);
        const Tensor logits = MakeTensor(*be_, dtype, {kRows, vocab}, z);
        const std::vector<double> flags = {1, 1, 1, 0, 1, 1};  // row 3 stopped
        const Tensor live = MakeTensor(*be_, DType::kI64, {kRows}, flags);
        std::vector<float> zf(z.begin(), z.end());
        for (float t : temperatures) {
          for (const Truncation& tr : truncations) {
            for (uint64_t step : {uint64_t{0}, uint64_t{3}}) {
              SampleParams p;
              p.temperature = t;
              p.top_k = tr.top_k;
              p.top_p = tr.top_p;
              p.seed = 1234;
              p.step = step;
              p.ignore_index = -100;
              absl::StatusOr<Tensor> tokens = be_->Allocate(DType::kI64, {kRows});
              ASSERT_TRUE(tokens.ok());
              ASSERT_TRUE(be_->SampleTokens(logits, live, p, *tokens).ok());
              std::vector<int64_t> got(kRows);
              ASSERT_TRUE(be_->CopyToHost(*tokens, got.data(), got.size() * 8).ok());
              for (int64_t r = 0; r < kRows; ++r) {
                int64_t want = -100;
                if (flags[static_cast<size_t>(r)] != 0) {
                  const philox::Block b =
                      philox::StreamBlock(p.seed, static_cast<uint64_t>(r), step);
                  const double u = philox::Unit53(b.v[0], b.v[1]);
                  want = ReferenceDraw(zf.data() + r * vocab, vocab,
                                       DrawInput{t, tr.top_k, tr.top_p}, u, order, weights);
                }
                EXPECT_EQ(got[static_cast<size_t>(r)], want)
                    << GetParam() << " " << DTypeName(dtype) << " V " << vocab << " spread "
                    << spread << " T " << t << " top_k " << tr.top_k << " top_p " << tr.top_p
                    << " step " << step << " row " << r;
                ++draws;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(draws, 1000);
}

// The log of the probability mass softmax(z / t) puts on the tokens a draw
// at (t, top_k, top_p) keeps, by the contract's definition (0 when nothing
// is cut), written apart from the draw's code.
double ReferenceLogKept(const float* z, int64_t vocab, const DrawInput& in) {
  if (in.temperature == 0.0f) return 0.0;
  const double t = static_cast<double>(in.temperature);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [z](int64_t a, int64_t b) { return z[a] > z[b]; });
  const double top = static_cast<double>(z[order[0]]) / t;
  std::vector<double> p(static_cast<size_t>(vocab));  // in `order`
  double all = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = std::exp(static_cast<double>(z[order[i]]) / t - top);
    all += p[i];
  }
  const int64_t keep = in.top_k > 0 && in.top_k < vocab ? in.top_k : vocab;
  double kept = 0.0;
  for (int64_t i = 0; i < keep; ++i) kept += p[static_cast<size_t>(i)];
  int64_t nucleus = keep;
  double mass = 0.0;
  for (int64_t i = 0; i < keep && in.top_p < 1.0f; ++i) {
    mass += p[static_cast<size_t>(i)] / kept;
    if (mass >= static_cast<double>(in.top_p)) {
      nucleus = i + 1;
      break;
    }
  }
  if (nucleus == vocab) return 0.0;
  double in_nucleus = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) in_nucleus += p[static_cast<size_t>(i)];
  return std::log(in_nucleus / all);
}

// log_kept against the reference: to float32 precision where something is
// cut, exactly 0 where nothing is (untruncated, top_k >= V, temperature 0)
// and for stopped rows; the tokens are those of the call without it.
TEST_P(SampleOpsTest, SampleTokensReportsTheLogOfTheKeptMass) {
  constexpr int64_t kRows = 6;
  struct Truncation {
    int64_t top_k;
    float top_p;
  };
  const Truncation truncations[] = {{0, 1.0f}, {1, 1.0f},  {5, 1.0f},    {0, 0.9f},
                                    {0, 0.3f}, {40, 0.8f}, {5000, 1.0f}, {5000, 0.95f}};
  std::mt19937_64 rng(17);
  int cut = 0;
  for (DType dtype : testing::kFloatTypes) {
    for (int64_t vocab : {1000, 4099}) {
      const std::vector<double> z = Logits(rng, dtype, kRows, vocab, 3.0);
      const Tensor logits = MakeTensor(*be_, dtype, {kRows, vocab}, z);
      const std::vector<double> flags = {1, 1, 1, 0, 1, 1};  // row 3 stopped
      const Tensor live = MakeTensor(*be_, DType::kI64, {kRows}, flags);
      const std::vector<float> zf(z.begin(), z.end());
      for (float t : {0.0f, 0.7f, 1.0f}) {
        for (const Truncation& tr : truncations) {
          SampleParams p;
          p.temperature = t;
          p.top_k = tr.top_k;
          p.top_p = tr.top_p;
          p.seed = 99;
          absl::StatusOr<Tensor> plain = be_->Allocate(DType::kI64, {kRows});
          absl::StatusOr<Tensor> tokens = be_->Allocate(DType::kI64, {kRows});
          ASSERT_TRUE(plain.ok() && tokens.ok());
          Tensor log_kept = MakeTensor(*be_, DType::kF32, {kRows}, std::vector<double>(kRows, 7));
          ASSERT_TRUE(be_->SampleTokens(logits, live, p, *plain).ok());
          p.log_kept = &log_kept;
          ASSERT_TRUE(be_->SampleTokens(logits, live, p, *tokens).ok());
          EXPECT_EQ(RawBytes(*be_, *tokens), RawBytes(*be_, *plain));
          const std::vector<double> got = testing::ReadTensor(*be_, log_kept);
          for (int64_t r = 0; r < kRows; ++r) {
            const double want = flags[static_cast<size_t>(r)] == 0
                                    ? 0.0
                                    : ReferenceLogKept(zf.data() + r * vocab, vocab,
                                                       DrawInput{t, tr.top_k, tr.top_p});
            const std::string where =
                absl::StrCat(GetParam(), " ", DTypeName(dtype), " V ", vocab, " T ", t, " top_k ",
                             tr.top_k, " top_p ", tr.top_p, " row ", r);
            if (want == 0.0) {
              EXPECT_EQ(got[static_cast<size_t>(r)], 0.0) << where;
            } else {
              EXPECT_NEAR(got[static_cast<size_t>(r)], want, 1e-6 * (1.0 + std::fabs(want)))
                  << where;
              EXPECT_LT(got[static_cast<size_t>(r)], 0.0) << where;
              ++cut;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cut, 100);
}

// Rows whose weights are NaN: all -inf (exp(-inf - -inf)) and one +inf
// (exp(inf - inf)) give the host draw's token, a NaN logit any in-range
// one. On CUDA, with nothing cut by top_k, the truncated path's searches
// then end at their lower bound, which must be a token of the row (it once
// was threshold 0, drawn as id -1).
TEST_P(SampleOpsTest, SampleTokensDrawsAnIdFromRowsWithNonFiniteLogits) {
  constexpr int64_t kVocab = 300;
  constexpr int64_t kRows = 3;
  const double inf = std::numeric_limits<double>::infinity();
  std::mt19937_64 rng(19);
  for (DType dtype : testing::kFloatTypes) {
    std::vector<double> z = RandomValues(rng, dtype, kRows * kVocab, -3.0, 3.0);
    std::fill(z.begin(), z.begin() + kVocab, -inf);  // row 0: all -inf
    z[kVocab + 123] = inf;                           // row 1: one +inf
    z[2 * kVocab + 45] = std::nan("");               // row 2: one NaN
    const Tensor logits = MakeTensor(*be_, dtype, {kRows, kVocab}, z);
    const Tensor live = MakeTensor(*be_, DType::kI64, {kRows}, {1, 1, 1});
    const std::vector<float> zf(z.begin(), z.end());
    std::vector<int64_t> order;
    std::vector<double> weights;
    for (float t : {0.0f, 1.0f}) {
      for (const DrawInput& in : {DrawInput{t, 0, 1.0f}, DrawInput{t, 0, 0.9f},
                                  DrawInput{t, kVocab, 1.0f}, DrawInput{t, 5, 0.5f}}) {
        SampleParams p;
        p.temperature = in.temperature;
        p.top_k = in.top_k;
        p.top_p = in.top_p;
        p.seed = 99;
        absl::StatusOr<Tensor> tokens = be_->Allocate(DType::kI64, {kRows});
        ASSERT_TRUE(tokens.ok());
        ASSERT_TRUE(be_->SampleTokens(logits, live, p, *tokens).ok());
        std::vector<int64_t> got(kRows);
        ASSERT_TRUE(be_->CopyToHost(*tokens, got.data(), got.size() * 8).ok());
        for (int64_t r = 0; r < kRows; ++r) {
          const std::string where = GetParam() + " " + std::string(DTypeName(dtype)) + " T " +
                                    std::to_string(t) + " top_k " + std::to_string(in.top_k) +
                                    " top_p " + std::to_string(in.top_p) + " row " +
                                    std::to_string(r);
          EXPECT_GE(got[static_cast<size_t>(r)], 0) << where;
          EXPECT_LT(got[static_cast<size_t>(r)], kVocab) << where;
          if (r == 2) continue;  // NaN: unspecified
          const philox::Block b = philox::StreamBlock(p.seed, static_cast<uint64_t>(r), p.step);
          const int64_t want = ReferenceDraw(zf.data() + r * kVocab, kVocab, in,
                                             philox::Unit53(b.v[0], b.v[1]), order, weights);
          EXPECT_EQ(got[static_cast<size_t>(r)], want) << where;
        }
      }
    }
  }
}

// Rows with keys of their own (SampleParams::keys): row r draws from
// (keys[r, 0], keys[r, 1]) whatever its index, so a row moved to another
// position with its key draws the same token; and top_k at or above V
// draws what top_k 0 draws.
TEST_P(SampleOpsTest, SampleTokensDrawsFromEachRowsOwnKey) {
  constexpr int64_t kRows = 5;
  constexpr int64_t kVocab = 777;
  std::mt19937_64 rng(23);
  const std::vector<double> z = RandomValues(rng, DType::kF32, kRows * kVocab, -2.0, 2.0);
  const Tensor logits = MakeTensor(*be_, DType::kF32, {kRows, kVocab}, z);
  const Tensor live = MakeTensor(*be_, DType::kI64, {kRows}, {1, 1, 0, 1, 1});
  // Keys with their high bits set too (uint64 read from the I64 bits).
  std::vector<int64_t> keys(2 * kRows);
  for (int64_t& k : keys) k = static_cast<int64_t>(rng());
  absl::StatusOr<Tensor> key_tensor = be_->Allocate(DType::kI64, {kRows, 2});
  ASSERT_TRUE(key_tensor.ok());
  ASSERT_TRUE(be_->CopyFromHost(keys.data(), keys.size() * 8, *key_tensor).ok());
  ASSERT_TRUE(be_->Synchronize().ok());
  const std::vector<float> zf(z.begin(), z.end());
  std::vector<int64_t> order;
  std::vector<double> weights;
  for (const DrawInput& in : {DrawInput{1.0f, 0, 1.0f}, DrawInput{0.8f, 0, 0.9f},
                              DrawInput{1.0f, 10, 1.0f}, DrawInput{1.0f, kVocab, 1.0f},
                              DrawInput{1.0f, kVocab + 1, 1.0f}, DrawInput{1.0f, 1 << 30, 0.7f}}) {
    for (uint64_t step : {uint64_t{0}, uint64_t{5}}) {
      SampleParams p;
      p.temperature = in.temperature;
      p.top_k = in.top_k;
      p.top_p = in.top_p;
      p.seed = 1;  // not read when keys are given
      p.step = step;
      p.keys = &*key_tensor;
      absl::StatusOr<Tensor> tokens = be_->Allocate(DType::kI64, {kRows});
      ASSERT_TRUE(tokens.ok());
      ASSERT_TRUE(be_->SampleTokens(logits, live, p, *tokens).ok());
      std::vector<int64_t> got(kRows);
      ASSERT_TRUE(be_->CopyToHost(*tokens, got.data(), got.size() * 8).ok());
      for (int64_t r = 0; r < kRows; ++r) {
        int64_t want = -100;
        if (r != 2) {
          const philox::Block b = philox::StreamBlock(
              static_cast<uint64_t>(keys[static_cast<size_t>(2 * r)]),
              static_cast<uint64_t>(keys[static_cast<size_t>(2 * r + 1)]), step);
          want = ReferenceDraw(zf.data() + r * kVocab, kVocab, in, philox::Unit53(b.v[0], b.v[1]),
                               order, weights);
          if (in.top_k >= kVocab) {
            // The same token as top_k 0 with the same uniform.
            DrawInput all = in;
            all.top_k = 0;
            EXPECT_EQ(want, ReferenceDraw(zf.data() + r * kVocab, kVocab, all,
                                          philox::Unit53(b.v[0], b.v[1]), order, weights));
          }
        }
        EXPECT_EQ(got[static_cast<size_t>(r)], want)
            << GetParam() << " top_k " << in.top_k << " top_p " << in.top_p << " step " << step
            << " row " << r;
      }
    }
  }
}

TEST_P(SampleOpsTest, SampleTokensRefusesBadParameters) {
  const Tensor logits = MakeTensor(*be_, DType::kF32, {2, 8}, std::vector<double>(16, 0.0));
  const Tensor live = MakeTensor(*be_, DType::kI64, {2}, {1, 1});
  Tensor tokens = MakeTensor(*be_, DType::kI64, {2}, {7, 7});
  const Tensor wrong = MakeTensor(*be_, DType::kI32, {2}, {1, 1});
  SampleParams p;
  auto refused = [&](const SampleParams& q, const Tensor& lv, Tensor& out) {
    testing::ExpectInvalid(be_->SampleTokens(logits, lv, q, out));
  };
  p.temperature = -1.0f;
  refused(p, live, tokens);
  p.temperature = std::nanf("");
  refused(p, live, tokens);
  p = SampleParams{};
  p.top_k = -1;
  refused(p, live, tokens);
  p = SampleParams{};
  p.top_p = 0.0f;
  refused(p, live, tokens);
  p.top_p = 1.5f;
  refused(p, live, tokens);
  p = SampleParams{};
  refused(p, wrong, tokens);  // live must be I64
  Tensor wrong_out = MakeTensor(*be_, DType::kI32, {2}, {7, 7});
  refused(p, live, wrong_out);
  const Tensor keys_i32 = MakeTensor(*be_, DType::kI32, {2, 2}, {1, 2, 3, 4});
  const Tensor keys_short = MakeTensor(*be_, DType::kI64, {1, 2}, {1, 2});
  const Tensor keys_flat = MakeTensor(*be_, DType::kI64, {4}, {1, 2, 3, 4});
  for (const Tensor* keys : {&keys_i32, &keys_short, &keys_flat}) {
    p.keys = keys;
    refused(p, live, tokens);  // keys must be (S, 2) I64
  }
  p.keys = nullptr;
  std::vector<int64_t> after(2);
  ASSERT_TRUE(be_->CopyToHost(tokens, after.data(), 16).ok());
  EXPECT_EQ(after, (std::vector<int64_t>{7, 7}));  // nothing written
}

// ---- WriteKvRows ---------------------------------------------------------------------
// Random bytes of a tensor's size, uploaded.
Tensor RandomBytes(Backend& be, std::mt19937_64& rng, DType dtype, const Shape& shape) {
  absl::StatusOr<Tensor> t = be.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok());
  std::vector<unsigned char> bytes(t->nbytes());
  for (unsigned char& c : bytes) c = static_cast<unsigned char>(rng());
  EXPECT_TRUE(be.CopyFromHost(bytes.data(), bytes.size(), *t).ok());
  return std::move(*t);
}

Tensor Upload(Backend& be, const std::vector<unsigned char>& bytes, DType dtype,
              const Shape& shape) {
  absl::StatusOr<Tensor> t = be.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok());
  EXPECT_TRUE(be.CopyFromHost(bytes.data(), bytes.size(), *t).ok());
  return std::move(*t);
}

TEST_P(SampleOpsTest, WriteKvRowsEqualsPerSequenceCopies) {
  const std::unique_ptr<Backend> oracle = CreateCpuBackend();
  std::mt19937_64 rng(11);
  struct Layout {
    int64_t width, k_col, v_col, row_width;
  };
  // GPT (q | k | v, C each), a GQA decoder (H D | Hkv D | Hkv D), and widths
  // and offsets that are no multiple of 16 bytes.
  const Layout layouts[] = {{64, 64, 128, 192}, {32, 128, 160, 192}, {7, 3, 11, 21}};
  constexpr int64_t kSeqs = 5;
  constexpr int64_t kMaxLen = 9;
  for (DType dtype : testing::kFloatTypes) {
    for (const Layout& l : layouts) {
      for (DType pos_dtype : {DType::kI64, DType::kI32}) {
        const Tensor rows = RandomBytes(*be_, rng, dtype, {kSeqs, l.row_width});
        const Tensor k0 = RandomBytes(*be_, rng, dtype, {kSeqs, kMaxLen, l.width});
        const Tensor v0 = RandomBytes(*be_, rng, dtype, {kSeqs, kMaxLen, l.width});
        const std::vector<double> at = {0, 8, 3, 3, 5};
        const Tensor positions = MakeTensor(*be_, pos_dtype, {kSeqs}, at);
        Tensor k = Upload(*be_, RawBytes(*be_, k0), dtype, k0.shape());
        Tensor v = Upload(*be_, RawBytes(*be_, v0), dtype, v0.shape());
        ASSERT_TRUE(be_->WriteKvRows(rows, l.k_col, l.v_col, positions, k, v).ok());

        // The copies it replaced, one row of K and one of V per sequence,
        // on the CPU oracle from the same bytes.
        const Tensor rows_c = Upload(*oracle, RawBytes(*be_, rows), dtype, rows.shape());
        Tensor k_c = Upload(*oracle, RawBytes(*be_, k0), dtype, k0.shape());
        Tensor v_c = Upload(*oracle, RawBytes(*be_, v0), dtype, v0.shape());
        for (int64_t s = 0; s < kSeqs; ++s) {
          const int64_t slot = s * kMaxLen + static_cast<int64_t>(at[static_cast<size_t>(s)]);
          absl::StatusOr<Tensor> row = rows_c.View(s * l.row_width, {1, l.row_width});
          absl::StatusOr<Tensor> key = k_c.View(slot * l.width, {1, l.width});
          absl::StatusOr<Tensor> value = v_c.View(slot * l.width, {1, l.width});
          ASSERT_TRUE(row.ok() && key.ok() && value.ok());
          ASSERT_TRUE(oracle->CopyColumns(*row, l.k_col, l.width, *key, 0).ok());
          ASSERT_TRUE(oracle->CopyColumns(*row, l.v_col, l.width, *value, 0).ok());
        }
        EXPECT_EQ(RawBytes(*be_, k), RawBytes(*oracle, k_c))
            << GetParam() << " " << DTypeName(dtype) << " W " << l.width;
        EXPECT_EQ(RawBytes(*be_, v), RawBytes(*oracle, v_c))
            << GetParam() << " " << DTypeName(dtype) << " W " << l.width;
      }
    }
  }
}

TEST_P(SampleOpsTest, WriteKvRowsRefusesBadOperands) {
  std::mt19937_64 rng(3);
  const Tensor rows = RandomBytes(*be_, rng, DType::kF32, {2, 12});
  Tensor k = RandomBytes(*be_, rng, DType::kF32, {2, 4, 4});
  Tensor v = RandomBytes(*be_, rng, DType::kF32, {2, 4, 4});
  const Tensor positions = MakeTensor(*be_, DType::kI64, {2}, {0, 1});
  Tensor k16 = RandomBytes(*be_, rng, DType::kF16, {2, 4, 4});
  testing::ExpectInvalid(be_->WriteKvRows(rows, 4, 9, positions, k, v));    // v block past R
  testing::ExpectInvalid(be_->WriteKvRows(rows, -1, 8, positions, k, v));   // negative column
  testing::ExpectInvalid(be_->WriteKvRows(rows, 4, 8, positions, k16, v));  // dtype
  testing::ExpectInvalid(be_->WriteKvRows(rows, 4, 8, positions, k, k));    // caches overlap
  const Tensor three = MakeTensor(*be_, DType::kI64, {3}, {0, 1, 2});
  testing::ExpectInvalid(be_->WriteKvRows(rows, 4, 8, three, k, v));
  if (GetParam() == "cpu") {
    // The CPU reads the positions: one out of range is refused, nothing written.
    const std::vector<unsigned char> before = RawBytes(*be_, k);
    const Tensor outside = MakeTensor(*be_, DType::kI64, {2}, {0, 4});
    testing::ExpectInvalid(be_->WriteKvRows(rows, 4, 8, outside, k, v));
    EXPECT_EQ(RawBytes(*be_, k), before);
  }
}

std::string BackendName(const ::testing::TestParamInfo<std::string>& param) {
  return param.param == "cpu" ? std::string("cpu") : std::string("cuda0");
}

INSTANTIATE_TEST_SUITE_P(Backends, SampleOpsTest,
                         ::testing::Values(std::string("cpu"), std::string("cuda:0")), BackendName);

}  // namespace
}  // namespace ampd::kernels
