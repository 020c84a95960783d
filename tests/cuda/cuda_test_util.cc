// Helpers for the CUDA-vs-CPU tests (see cuda_test_util.h).
#include "tests/cuda/cuda_test_util.h"

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/float16.h"

namespace ampd::kernels::cuda_test {

void CudaVsCpuTest::SetUp() {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device visible: the CUDA backend is compared with the CPU oracle "
                    "only on a machine with a GPU";
  }
  absl::StatusOr<std::unique_ptr<Backend>> gpu = CreateBackend("cuda:0");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  gpu_ = *std::move(gpu);
  cpu_ = CreateCpuBackend();
  ASSERT_NE(cpu_, nullptr) << "CreateCpuBackend() returned null";
}

std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) {
  return std::string(DTypeName(info.param));
}

namespace {

float RoundTo(DType dtype, float v) {
  switch (dtype) {
    case DType::kF16:
      return RoundToHalf(v);
    case DType::kBF16:
      return RoundToBf16(v);
    default:
      return v;
  }
}

}  // namespace

std::vector<float> RandomValues(int64_t n, uint32_t seed, float lo, float hi, DType dtype) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  const float floor_abs = 1e-3f * std::max(std::fabs(lo), std::fabs(hi));
  std::vector<float> out(static_cast<size_t>(n));
  for (float& v : out) {
    float x = dist(rng);
    if (std::fabs(x) < floor_abs) x = x < 0 ? -floor_abs : floor_abs;
    v = RoundTo(dtype, x);
  }
  return out;
}

std::vector<int64_t> RandomIds(int64_t n, uint32_t seed, int64_t limit) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, limit - 1);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t& v : out) v = dist(rng);
  return out;
}

Tensor Upload(Backend& backend, DType dtype, const Shape& shape, const std::vector<float>& values) {
  absl::StatusOr<Tensor> t = backend.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return Tensor();
  EXPECT_EQ(static_cast<int64_t>(values.size()), t->numel());
  std::vector<uint8_t> bytes(t->nbytes());
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits =
          dtype == DType::kF16 ? FloatToHalfBits(values[i]) : FloatToBf16Bits(values[i]);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  const absl::Status s = backend.CopyFromHost(bytes.data(), bytes.size(), *t);
  EXPECT_TRUE(s.ok()) << s;
  return *std::move(t);
}

Tensor UploadIds(Backend& backend, DType dtype, const Shape& shape,
                 const std::vector<int64_t>& ids) {
  absl::StatusOr<Tensor> t = backend.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return Tensor();
  absl::Status s;
  if (dtype == DType::kI64) {
    s = backend.CopyFromHost(ids.data(), ids.size() * 8, *t);
  } else {
    std::vector<int32_t> narrow(ids.begin(), ids.end());
    s = backend.CopyFromHost(narrow.data(), narrow.size() * 4, *t);
  }
  EXPECT_TRUE(s.ok()) << s;
  return *std::move(t);
}

std::vector<uint8_t> DownloadBytes(Backend& backend, const Tensor& t) {
  std::vector<uint8_t> bytes(t.nbytes());
  const absl::Status s = backend.CopyToHost(t, bytes.data(), bytes.size());
  EXPECT_TRUE(s.ok()) << backend.name() << ": " << s;
  return bytes;
}

std::vector<float> Download(Backend& backend, const Tensor& t) {
  const std::vector<uint8_t> bytes = DownloadBytes(backend, t);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype() == DType::kF32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      out[i] = t.dtype() == DType::kF16 ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
    }
  }
  return out;
}

std::vector<int64_t> DownloadI64(Backend& backend, const Tensor& t) {
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  const absl::Status s = backend.CopyToHost(t, out.data(), out.size() * 8);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

Tolerance ElementwiseTolerance(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return {2e-3f, 1e-5f};  // two fp16 ulps (2^-10 each, relative)
    case DType::kBF16:
      return {1.6e-2f, 1e-4f};  // two bf16 ulps (2^-7 each, relative)
    default:
      return {1e-5f, 1e-7f};
  }
}

::testing::AssertionResult AllClose(const std::vector<float>& want, const std::vector<float>& got,
                                    Tolerance tol) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: want " << want.size() << ", got " << got.size();
  }
  int bad = 0;
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  for (size_t i = 0; i < want.size(); ++i) {
    const float w = want[i];
    const float g = got[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
    } else if (std::isinf(w) || std::isinf(g)) {
      ok = w == g;
    } else {
      ok = std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w);
    }
    if (!ok && bad++ < 5) {
      failure << "[" << i << "] want " << w << " got " << g << " (diff " << (g - w) << "); ";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure << bad << " of " << want.size() << " elements differ beyond rtol " << tol.rtol
                 << " atol " << tol.atol;
}

bool Mentions(const absl::Status& status, const char* what) {
  return std::string(status.message()).find(what) != std::string::npos;
}

}  // namespace ampd::kernels::cuda_test
