// Shared fixture and helpers for the CUDA-vs-CPU tests: a fixture that skips
// without a GPU and holds one backend of each kind, host<->tensor transfers
// that go through exact fp16/bf16 bit conversions, seeded random inputs
// (never zeros), and tolerance comparisons per dtype.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace ampd::kernels::cuda_test {

// Skips (the only skip these tests allow) when no CUDA device is visible,
// then creates cuda:0 and the CPU oracle.
class CudaVsCpuTest : public ::testing::Test {
 protected:
  void SetUp() override;
  std::unique_ptr<Backend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

// The same, parametrised over the float dtype under test (ggml-style: one
// fixture, every op, every dtype).
class CudaDTypeTest : public CudaVsCpuTest, public ::testing::WithParamInterface<DType> {};
std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info);

// n uniform values in [lo, hi), rounded to `dtype` so both backends receive
// exactly the same numbers; |v| >= 1e-3 * max(|lo|, |hi|) so no value is 0.
std::vector<float> RandomValues(int64_t n, uint32_t seed, float lo, float hi, DType dtype);
// Random ids in [0, limit).
std::vector<int64_t> RandomIds(int64_t n, uint32_t seed, int64_t limit);

// Uploads `values` converted to `dtype` (exact RNE for F16/BF16).
Tensor Upload(Backend& backend, DType dtype, const Shape& shape, const std::vector<float>& values);
Tensor UploadIds(Backend& backend, DType dtype, const Shape& shape,
                 const std::vector<int64_t>& ids);
std::vector<float> Download(Backend& backend, const Tensor& t);
std::vector<int64_t> DownloadI64(Backend& backend, const Tensor& t);
// Raw bytes, for bitwise comparisons.
std::vector<uint8_t> DownloadBytes(Backend& backend, const Tensor& t);

struct Tolerance {
  float rtol;
  float atol;
};
// Elementwise ops: a few units in the last place of the dtype, since CUDA's
// erff/expf/tanhf may differ from glibc's by an ulp before the final rounding.
Tolerance ElementwiseTolerance(DType dtype);

// Every element |got - want| <= atol + rtol |want| (NaN matches NaN, inf
// matches the same inf); reports the first few mismatches.
::testing::AssertionResult AllClose(const std::vector<float>& want, const std::vector<float>& got,
                                    Tolerance tol);

// True when the status message contains `what` (an operand name).
bool Mentions(const absl::Status& status, const char* what);

}  // namespace ampd::kernels::cuda_test

// Asserts that an op returned OK, printing the expression and the status.
#define AMPD_EXPECT_OK(expr)                               \
  do {                                                     \
    const ::absl::Status ampd_s_ = (expr);                 \
    ASSERT_TRUE(ampd_s_.ok()) << #expr << ": " << ampd_s_; \
  } while (0)
