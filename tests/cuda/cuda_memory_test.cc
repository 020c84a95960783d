// The CUDA backend's memory: BytesInUse counts live tensor bytes, the
// per-device pool serves a warm step without cudaMalloc, blocks are shared
// (safely ordered) between backends on the same device, and host copies of
// state-load sizes arrive whole past the bounded pinned staging buffers.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/backend_factory.h"
#include "kernels/cuda/memory_pool.h"
#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

TEST_F(CudaVsCpuTest, BytesInUseCountsLiveTensors) {
  const int64_t base = gpu_->BytesInUse();
  {
    Tensor a = *gpu_->Allocate(DType::kF16, {1000});
    Tensor b = *gpu_->Allocate(DType::kF32, {3, 7});
    EXPECT_EQ(gpu_->BytesInUse(), base + 2000 + 84);
  }
  EXPECT_EQ(gpu_->BytesInUse(), base);
}

TEST_F(CudaVsCpuTest, WarmStepAllocatesNothingFromTheDriver) {
  cuda::DevicePool& pool = cuda::DevicePool::ForDevice(0);
  const std::vector<Shape> step_shapes = {{256, 1024}, {1024, 1024}, {1024}, {1}, {7, 33}};
  auto run_step = [&] {
    std::vector<Tensor> live;
    for (const Shape& s : step_shapes) {
      live.push_back(*gpu_->Allocate(DType::kF16, s));
      ASSERT_TRUE(gpu_->Fill(live.back(), 1.5f).ok());
    }
  };
  run_step();  // warm-up
  const int64_t mallocs = pool.stats().device_allocations;
  for (int i = 0; i < 5; ++i) run_step();
  EXPECT_EQ(pool.stats().device_allocations, mallocs);
}

TEST_F(CudaVsCpuTest, BlocksMoveBetweenBackendsInStreamOrder) {
  absl::StatusOr<std::unique_ptr<Backend>> other = CreateBackend("cuda:0");
  ASSERT_TRUE(other.ok()) << other.status();
  const auto v = RandomValues(1 << 20, 700, -1, 1, DType::kF32);
  std::vector<float> got;
  for (int round = 0; round < 3; ++round) {
    {
      // Written on gpu_'s stream and released while possibly still queued.
      Tensor a = Upload(*gpu_, DType::kF32, {1 << 20}, v);
      ASSERT_TRUE(gpu_->Fill(a, 2.0f).ok());
    }
    // The same size class on another backend's stream must not see gpu_'s
    // pending Fill land after its own writes.
    Tensor b = Upload(**other, DType::kF32, {1 << 20}, v);
    got = Download(**other, b);
    EXPECT_EQ(got, v) << "round " << round;
  }
}

// A state load's shape of work: many uploads of up to the largest staged
// size (64 MiB) with no synchronisation between them, more than the upload
// arena's 128 MiB cap, then a larger one that goes straight from the
// caller's memory. Every tensor must arrive whole, whichever way it went.
TEST_F(CudaVsCpuTest, ManyLargeUploadsArriveWholePastTheArenaCap) {
  constexpr int64_t kStaged = int64_t{16} << 20;  // floats: 64 MiB, the largest staged upload
  std::vector<std::vector<float>> values;
  std::vector<Tensor> tensors;
  for (int i = 0; i < 5; ++i) {
    values.push_back(
        RandomValues(kStaged - i * 4099, 900 + static_cast<uint32_t>(i), -4, 4, DType::kF32));
    tensors.push_back(*gpu_->Allocate(DType::kF32, {static_cast<int64_t>(values.back().size())}));
    ASSERT_TRUE(gpu_->CopyFromHost(values.back().data(), values.back().size() * sizeof(float),
                                   tensors.back())
                    .ok());
  }
  values.push_back(RandomValues(kStaged + 12345, 999, -4, 4, DType::kF32));
  tensors.push_back(*gpu_->Allocate(DType::kF32, {static_cast<int64_t>(values.back().size())}));
  ASSERT_TRUE(
      gpu_->CopyFromHost(values.back().data(), values.back().size() * sizeof(float), tensors.back())
          .ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(Download(*gpu_, tensors[i]) == values[i]) << "tensor " << i;
  }
}

// ReadBack lands copies of more than 64 MiB straight in the caller's
// memory and smaller ones through its pinned buffer, in one call with the
// step's scalars: all of them must hold the device's bytes afterwards.
TEST_F(CudaVsCpuTest, ReadBackOfLargeAndSmallCopiesTogether) {
  const std::vector<float> big = RandomValues((int64_t{16} << 20) + 777, 41, -2, 2, DType::kF32);
  const std::vector<float> small = RandomValues(1000, 42, -2, 2, DType::kF32);
  const Tensor big_t = Upload(*gpu_, DType::kF32, {static_cast<int64_t>(big.size())}, big);
  const Tensor small_t = Upload(*gpu_, DType::kF32, {static_cast<int64_t>(small.size())}, small);
  const Tensor scalar = Upload(*gpu_, DType::kF32, {1}, {3.5f});
  std::vector<float> big_out(big.size(), 0.0f);
  std::vector<float> small_out(small.size(), 0.0f);
  const std::vector<HostCopy> copies = {{&small_t, small_out.data(), small.size() * sizeof(float)},
                                        {&big_t, big_out.data(), big.size() * sizeof(float)}};
  const Tensor* scalars[] = {&scalar};
  float read[1] = {0.0f};
  ASSERT_TRUE(gpu_->ReadBack(scalars, absl::MakeSpan(read), copies).ok());
  EXPECT_EQ(read[0], 3.5f);
  EXPECT_TRUE(big_out == big);
  EXPECT_TRUE(small_out == small);
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
