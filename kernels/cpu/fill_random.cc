// FillRandom: counter-based Philox draws (kernels/philox.h) written straight
// into an F32 tensor. Each chunk of the tensor computes its own Philox
// blocks, so the chunks run on any threads in any order and the bits are
// those the CUDA kernel writes for the same (seed, stream, offset).
#include <algorithm>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/philox.h"

namespace ampd::kernels::cpu {
namespace {

// Elements per chunk: a multiple of 4 so that, for a block-aligned offset,
// no Philox block is computed by two chunks.
constexpr int64_t kRandomGrain = 1 << 16;

// out[0, n) = uniform draws first .. first + n - 1.
void UniformRange(const RandomFill& f, uint64_t first, int64_t n, float* out) {
  int64_t i = 0;
  while (i < n) {
    const uint64_t d = first + static_cast<uint64_t>(i);
    const philox::Block b = philox::StreamBlock(f.seed, f.stream, d / 4);
    for (uint64_t w = d % 4; w < 4 && i < n; ++w, ++i) {
      out[i] = philox::UniformFromWord(b.v[w], f.lo, f.hi);
    }
  }
}

// out[0, n) = normal draws first .. first + n - 1.
void NormalRange(const RandomFill& f, uint64_t first, int64_t n, float* out) {
  int64_t i = 0;
  while (i < n) {
    const uint64_t d = first + static_cast<uint64_t>(i);
    float z[2];
    philox::NormalPairFromBlock(philox::StreamBlock(f.seed, f.stream, d / 2), f.mean, f.stddev,
                                z[0], z[1]);
    for (uint64_t h = d % 2; h < 2 && i < n; ++h, ++i) out[i] = z[h];
  }
}

}  // namespace

absl::Status FillRandom(ThreadPool& pool, Tensor& dst, const RandomFill& fill) {
  if (absl::Status s = ValidateFillRandom(dst, fill); !s.ok()) return s;
  float* out = dst.data_as<float>();
  const bool uniform = fill.distribution == RandomDistribution::kUniform;
  pool.ParallelFor(dst.numel(), kRandomGrain, [&](int64_t begin, int64_t end) {
    const uint64_t first = fill.offset + static_cast<uint64_t>(begin);
    if (uniform) {
      UniformRange(fill, first, end - begin, out + begin);
    } else {
      NormalRange(fill, first, end - begin, out + begin);
    }
  });
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
