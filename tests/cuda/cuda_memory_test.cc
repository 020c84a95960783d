// The CUDA backend's memory: BytesInUse counts live tensor bytes, the
// per-device pool serves a warm step without cudaMalloc, and blocks are
// shared (safely ordered) between backends on the same device.
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

}  // namespace
}  // namespace ampd::kernels::cuda_test
