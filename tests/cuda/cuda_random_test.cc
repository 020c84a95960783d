// FillRandom on cuda:0 against the CPU oracle: the same bits for uniform and
// normal draws, whole tensors and pieces starting mid-block, and the same
// argument errors. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

RandomFill Fill(RandomDistribution dist, uint64_t seed, uint64_t stream, uint64_t offset) {
  RandomFill f;
  f.distribution = dist;
  f.lo = -0.03125f;  // 1 / sqrt(1024), a Linear(1024, .) bound
  f.hi = 0.03125f;
  f.mean = 0.25f;
  f.stddev = 1.5f;
  f.seed = seed;
  f.stream = stream;
  f.offset = offset;
  return f;
}

TEST_F(CudaVsCpuTest, FillRandomIsBitIdenticalToTheCpu) {
  // Sizes around the block and grid boundaries; offsets 0, mid-block and
  // far into the 64-bit counter.
  const int64_t sizes[] = {1, 3, 4, 5, 1023, 4097, 1 << 20, (1 << 22) + 3};
  const uint64_t offsets[] = {0, 1, 2, 3, 1ull << 40};
  for (RandomDistribution dist : {RandomDistribution::kUniform, RandomDistribution::kNormal}) {
    for (int64_t n : sizes) {
      for (uint64_t offset : offsets) {
        const RandomFill f = Fill(dist, 0x5eed0000000000abull + static_cast<uint64_t>(n),
                                  static_cast<uint64_t>(n) * 31 + offset, offset);
        Tensor c = *cpu_->Allocate(DType::kF32, {n});
        Tensor g = *gpu_->Allocate(DType::kF32, {n});
        AMPD_EXPECT_OK(cpu_->FillRandom(c, f));
        AMPD_EXPECT_OK(gpu_->FillRandom(g, f));
        ASSERT_EQ(DownloadBytes(*cpu_, c), DownloadBytes(*gpu_, g))
            << (dist == RandomDistribution::kUniform ? "uniform" : "normal") << " n " << n
            << " offset " << offset;
      }
    }
  }
}

TEST_F(CudaVsCpuTest, FillRandomRejectsWhatTheCpuRejects) {
  Tensor g16 = *gpu_->Allocate(DType::kF16, {8});
  Tensor c16 = *cpu_->Allocate(DType::kF16, {8});
  RandomFill f = Fill(RandomDistribution::kUniform, 1, 1, 0);
  const absl::Status gs = gpu_->FillRandom(g16, f);
  EXPECT_EQ(gs.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gs, cpu_->FillRandom(c16, f));
  Tensor g = *gpu_->Allocate(DType::kF32, {8});
  Tensor c = *cpu_->Allocate(DType::kF32, {8});
  f.offset = std::numeric_limits<uint64_t>::max() - 7;
  EXPECT_EQ(gpu_->FillRandom(g, f).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->FillRandom(g, f), cpu_->FillRandom(c, f));
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
