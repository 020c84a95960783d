// UnscaleAndCheck: a single inf or NaN anywhere in a list of gradients of
// mixed dtypes is found (the last element of the last tensor included);
// large finite values (fp16's 65504) are not; in-place unscaling and the
// squared norm match float64 references; found_inf is never cleared.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::ExpectInvalid;
using testing::kEps32;
using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;
using testing::RefStore;

struct GradSpec {
  DType dtype;
  Shape shape;
};

// Sizes straddle the fp32 summation chunk (1024) so the tail paths run too.
const GradSpec kSpecs[] = {{DType::kF16, {3, 5}},
                           {DType::kF32, {7}},
                           {DType::kBF16, {2, 3, 4}},
                           {DType::kF16, {1}},
                           {DType::kF32, {33, 37}}};

class UnscaleTest : public ::testing::Test {
 protected:
  // Fresh random gradients (finite, never zero-filled) for every spec.
  void MakeGrads(uint64_t seed) {
    std::mt19937_64 rng(seed);
    grads_.clear();
    values_.clear();
    for (const GradSpec& s : kSpecs) {
      values_.push_back(
          RandomValues(rng, s.dtype, static_cast<size_t>(NumElements(s.shape)), -1000.0, 1000.0));
      grads_.push_back(MakeTensor(*be_, s.dtype, s.shape, values_.back()));
    }
  }
  std::vector<Tensor*> Ptrs() {
    std::vector<Tensor*> p;
    for (Tensor& t : grads_) p.push_back(&t);
    return p;
  }
  double FoundInf(bool in_place, Tensor* norm_sq) {
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    const std::vector<Tensor*> p = Ptrs();
    EXPECT_TRUE(be_->UnscaleAndCheck(p, 0.125f, in_place, found, norm_sq).ok());
    return ReadTensor(*be_, found)[0];
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::vector<Tensor> grads_;
  std::vector<std::vector<double>> values_;
};

TEST_F(UnscaleTest, FindsOneNonFiniteValueAtEveryPosition) {
  MakeGrads(7);
  ASSERT_EQ(FoundInf(false, nullptr), 0.0);
  const double bad_values[] = {INFINITY, -INFINITY, NAN};
  for (size_t t = 0; t < grads_.size(); ++t) {
    for (size_t i = 0; i < values_[t].size(); ++i) {
      for (const double bad : bad_values) {
        // Plant the value, check every mode, then restore the finite one.
        std::vector<double> planted = values_[t];
        planted[i] = bad;
        grads_[t] = MakeTensor(*be_, kSpecs[t].dtype, kSpecs[t].shape, planted);
        ASSERT_EQ(FoundInf(false, nullptr), 1.0) << "tensor " << t << " element " << i;
        Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {0.0});
        ASSERT_EQ(FoundInf(false, &norm), 1.0) << "tensor " << t << " element " << i;
        ASSERT_FALSE(std::isfinite(ReadTensor(*be_, norm)[0]));
        grads_[t] = MakeTensor(*be_, kSpecs[t].dtype, kSpecs[t].shape, values_[t]);
      }
    }
  }
  // The last element of the last tensor, explicitly, in place as well.
  std::vector<double> planted = values_.back();
  planted.back() = INFINITY;
  grads_.back() = MakeTensor(*be_, kSpecs[4].dtype, kSpecs[4].shape, planted);
  EXPECT_EQ(FoundInf(true, nullptr), 1.0);
}

TEST_F(UnscaleTest, LargeFiniteValuesDoNotFire) {
  auto be = CreateCpuBackend();
  Tensor h = MakeTensor(*be, DType::kF16, {4}, {65504.0, -65504.0, 1.0, -0.5});
  Tensor b = MakeTensor(*be, DType::kBF16, {2}, {3.3895313892515355e38, -std::ldexp(1.0, 100)});
  Tensor f = MakeTensor(*be, DType::kF32, {2}, {3.4028234663852886e38, -std::ldexp(1.0, 127)});
  Tensor found = MakeTensor(*be, DType::kF32, {1}, {0.0});
  Tensor* list[] = {&h, &b, &f};
  // inv_scale 1: the squares overflow fp32, the values themselves are finite.
  Tensor norm = MakeTensor(*be, DType::kF32, {1}, {0.0});
  ASSERT_TRUE(be->UnscaleAndCheck(list, 1.0f, false, found, &norm).ok());
  EXPECT_EQ(ReadTensor(*be, found)[0], 0.0);
  ASSERT_TRUE(be->UnscaleAndCheck(list, 1.0f / 65536.0f, true, found, nullptr).ok());
  EXPECT_EQ(ReadTensor(*be, found)[0], 0.0);
}

// The check is on g * inv_scale, the value the optimizer consumes: a loss
// scale of 0 (inv_scale inf) or a subnormal one (an inv_scale large enough to
// overflow a finite g) must flag the step, zero gradients included (0 * inf
// is NaN); an inv_scale of 0 makes every product 0 and does not.
TEST_F(UnscaleTest, NonFiniteUnscaledProductFires) {
  for (const DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dtype));
    struct Case {
      std::vector<double> values;
      float inv_scale;
      double want;
    };
    const Case cases[] = {
        {{0.0, 0.0, -0.0}, INFINITY, 1.0},   // all-zero grads, scale 0
        {{1.0, -0.5, 0.25}, INFINITY, 1.0},  // finite grads, scale 0
        {{0.0, 2.0, 0.0}, 0x1.0p100f, 0.0},  // 2^101 is finite (its square is not)
        {{0.0, 0.0, 0.0}, 0x1.0p127f, 0.0},  // 0 * large finite inv_scale: 0
        {{1.0, -0.5, 0.25}, 0.0f, 0.0},      // inv_scale 0: every product is 0
    };
    for (const Case& c : cases) {
      Tensor g = MakeTensor(*be_, dtype, {3}, c.values);
      Tensor* list[] = {&g};
      Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
      Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {0.0});
      ASSERT_TRUE(be_->UnscaleAndCheck(list, c.inv_scale, false, found, &norm).ok());
      EXPECT_EQ(ReadTensor(*be_, found)[0], c.want) << "inv_scale " << c.inv_scale;
    }
    // 2^-10 * 2^127 = 2^117 is finite, 4 * 2^127 = 2^129 overflows fp32.
    Tensor g = MakeTensor(*be_, dtype, {2}, {0x1.0p-10, 4.0});
    Tensor* list[] = {&g};
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    ASSERT_TRUE(be_->UnscaleAndCheck(list, 0x1.0p127f, false, found, nullptr).ok());
    EXPECT_EQ(ReadTensor(*be_, found)[0], 1.0);
  }
}

TEST_F(UnscaleTest, FoundInfIsNeverCleared) {
  MakeGrads(8);
  Tensor found = MakeTensor(*be_, DType::kF32, {1}, {1.0});
  const std::vector<Tensor*> p = Ptrs();
  ASSERT_TRUE(be_->UnscaleAndCheck(p, 0.5f, false, found, nullptr).ok());
  EXPECT_EQ(ReadTensor(*be_, found)[0], 1.0);
}

TEST_F(UnscaleTest, InPlaceValuesAndNormMatchReference) {
  MakeGrads(9);
  const float inv_scale = 1.0f / 1024.0f * 3.0f;  // not a power of two: products round
  Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {2.5});  // accumulates onto 2.5
  const std::vector<Tensor*> p = Ptrs();
  ASSERT_TRUE(be_->UnscaleAndCheck(p, inv_scale, true, found, &norm).ok());
  EXPECT_EQ(ReadTensor(*be_, found)[0], 0.0);
  double want_norm = 2.5;
  double abs_sum = 2.5;
  for (size_t t = 0; t < grads_.size(); ++t) {
    const std::vector<double> got = ReadTensor(*be_, grads_[t]);
    for (size_t i = 0; i < got.size(); ++i) {
      // fp32 product (exactly the double product rounded to float), then one
      // rounding to the gradient's dtype.
      const double u = static_cast<double>(static_cast<float>(values_[t][i] * inv_scale));
      ASSERT_EQ(got[i], RefStore(kSpecs[t].dtype, u)) << "tensor " << t << " element " << i;
      want_norm += u * u;
      abs_sum += u * u;
    }
  }
  // fp32 chunked summation: error below (chunk + chunks + tensors) roundings.
  const double got_norm = ReadTensor(*be_, norm)[0];
  EXPECT_NEAR(got_norm, want_norm, 2048 * kEps32 * abs_sum);
  EXPECT_NEAR(got_norm, want_norm, 1e-5 * want_norm);
}

TEST_F(UnscaleTest, CheckOnlyLeavesGradientsUntouched) {
  MakeGrads(10);
  Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  const std::vector<Tensor*> p = Ptrs();
  ASSERT_TRUE(be_->UnscaleAndCheck(p, 0.25f, false, found, &norm).ok());
  double want = 0.0;
  for (size_t t = 0; t < grads_.size(); ++t) {
    EXPECT_EQ(ReadTensor(*be_, grads_[t]), values_[t]);
    for (double v : values_[t]) want += (v * 0.25) * (v * 0.25);
  }
  EXPECT_NEAR(ReadTensor(*be_, norm)[0], want, 1e-5 * want);
}

TEST_F(UnscaleTest, BadArgumentsAreInvalidArgument) {
  MakeGrads(11);
  std::vector<Tensor*> p = Ptrs();
  Tensor found2 = MakeTensor(*be_, DType::kF32, {2}, {0.0, 0.0});
  ExpectInvalid(be_->UnscaleAndCheck(p, 1.0f, false, found2, nullptr));
  Tensor found_f16 = MakeTensor(*be_, DType::kF16, {1}, {0.0});
  ExpectInvalid(be_->UnscaleAndCheck(p, 1.0f, false, found_f16, nullptr));
  Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  Tensor norm_i = MakeTensor(*be_, DType::kI64, {1}, {0.0});
  ExpectInvalid(be_->UnscaleAndCheck(p, 1.0f, false, found, &norm_i));
  Tensor ids = MakeTensor(*be_, DType::kI32, {3}, {1.0, 2.0, 3.0});
  p.push_back(&ids);
  ExpectInvalid(be_->UnscaleAndCheck(p, 1.0f, false, found, nullptr));
  p.back() = nullptr;
  ExpectInvalid(be_->UnscaleAndCheck(p, 1.0f, false, found, nullptr));
}

}  // namespace
}  // namespace ampd::kernels
