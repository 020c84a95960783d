// ampd_bench_cuda_attention: GPU time of the fused causal attention at one
// GPT-2 small layer's shape (B = 8, T = 1024, 12 heads of 64, bf16 and
// fp16), forward and backward, for the default register-tile kernels and
// the earlier wmma ones (CudaBackendOptions::attention_wmma), with the
// TFLOP/s of the causal products (forward 2 x 2 B H T^2 D / 2, backward
// 2.5 times that, as flash-attention counts them). Then the same shape
// with a sliding window of 256 keys (Gemma 3's local layers, at a quarter
// of T), which takes the generic kernels: the figure its tensor-core path
// will be measured against.
//
// Usage: ampd_bench_cuda_attention [runs=20]
// Prints the median of `runs` calls, timed with device events on the
// backend's stream after two warm-up calls, on random data.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"

namespace {

using ampd::bench::Check;
using ampd::bench::Median;
using ampd::kernels::Backend;
using ampd::kernels::DType;
using ampd::kernels::Tensor;

// (n) values uniform in [-1, 1) as F32, cast on the device to dtype.
Tensor Random(Backend& b, DType dtype, const ampd::kernels::Shape& shape, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : v) x = u(rng);
  absl::StatusOr<Tensor> f32 = b.Allocate(DType::kF32, shape);
  absl::StatusOr<Tensor> t = b.Allocate(dtype, shape);
  Check(f32.status(), "Allocate");
  Check(t.status(), "Allocate");
  Check(b.CopyFromHost(v.data(), v.size() * sizeof(float), *f32), "CopyFromHost");
  Check(b.Cast(*f32, *t), "Cast");
  Check(b.Synchronize(), "Synchronize");
  return *std::move(t);
}

// Median device milliseconds of op over runs calls after two warm-ups.
template <typename Op>
double DeviceMs(Backend& b, int runs, Op op) {
  auto* stream = static_cast<cudaStream_t>(b.native_stream().stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    std::fprintf(stderr, "cudaEventCreate failed\n");
    std::exit(1);
  }
  std::vector<double> ms;
  for (int i = 0; i < runs + 2; ++i) {
    float elapsed = 0;
    if (cudaEventRecord(start, stream) != cudaSuccess) std::exit(1);
    Check(op(), "attention");
    if (cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&elapsed, start, stop) != cudaSuccess) {
      std::fprintf(stderr, "event timing failed\n");
      std::exit(1);
    }
    if (i >= 2) ms.push_back(elapsed);
  }
  Check(b.Synchronize(), "Synchronize");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  if (ampd::kernels::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "ampd_bench_cuda_attention: no CUDA device visible\n");
    return 1;
  }
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  const int64_t batch = 8, seq = 1024, heads = 12, head_dim = 64, c = heads * head_dim;
  const double fwd_flop = 2.0 * 2.0 * batch * heads * static_cast<double>(seq) * seq * head_dim / 2;
  for (const bool wmma : {false, true}) {
    ampd::kernels::cuda::CudaBackendOptions options;
    options.attention_wmma = wmma;
    absl::StatusOr<std::unique_ptr<Backend>> be =
        ampd::kernels::cuda::CreateCudaBackend(0, options);
    Check(be.status(), "CreateCudaBackend");
    Backend& b = **be;
    for (const DType dt : {DType::kBF16, DType::kF16}) {
      Tensor qkv = Random(b, dt, {batch, seq, 3 * c}, 1);
      Tensor dout = Random(b, dt, {batch, seq, c}, 2);
      absl::StatusOr<Tensor> out = b.Allocate(dt, {batch, seq, c});
      absl::StatusOr<Tensor> lse = b.Allocate(DType::kF32, {batch, heads, seq});
      absl::StatusOr<Tensor> dqkv = b.Allocate(dt, {batch, seq, 3 * c});
      Check(out.status(), "Allocate");
      Check(lse.status(), "Allocate");
      Check(dqkv.status(), "Allocate");
      const double fwd =
          DeviceMs(b, runs, [&] { return b.AttentionForward(qkv, heads, *out, *lse); });
      const double bwd = DeviceMs(
          b, runs, [&] { return b.AttentionBackward(qkv, *out, dout, *lse, heads, *dqkv); });
      std::printf(
          "attention B=%lld T=%lld H=%lld D=%lld %s, %s kernels: forward %.3f ms (%.0f TFLOP/s), "
          "backward %.3f ms (%.0f TFLOP/s)\n",
          static_cast<long long>(batch), static_cast<long long>(seq), static_cast<long long>(heads),
          static_cast<long long>(head_dim), dt == DType::kBF16 ? "bf16" : "fp16",
          wmma ? "wmma" : "register-tile", fwd, fwd_flop / fwd / 1e9, bwd,
          2.5 * fwd_flop / bwd / 1e9);
    }
  }
  {
    absl::StatusOr<std::unique_ptr<Backend>> be = ampd::kernels::cuda::CreateCudaBackend(0, {});
    Check(be.status(), "CreateCudaBackend");
    Backend& b = **be;
    ampd::kernels::AttentionOptions window;
    window.window = 256;
    for (const DType dt : {DType::kBF16, DType::kF16}) {
      Tensor qkv = Random(b, dt, {batch, seq, 3 * c}, 1);
      Tensor dout = Random(b, dt, {batch, seq, c}, 2);
      absl::StatusOr<Tensor> out = b.Allocate(dt, {batch, seq, c});
      absl::StatusOr<Tensor> lse = b.Allocate(DType::kF32, {batch, heads, seq});
      absl::StatusOr<Tensor> dqkv = b.Allocate(dt, {batch, seq, 3 * c});
      Check(out.status(), "Allocate");
      Check(lse.status(), "Allocate");
      Check(dqkv.status(), "Allocate");
      const double fwd =
          DeviceMs(b, runs, [&] { return b.AttentionForward(qkv, heads, window, *out, *lse); });
      const double bwd = DeviceMs(b, runs, [&] {
        return b.AttentionBackward(qkv, *out, dout, *lse, heads, window, *dqkv);
      });
      std::printf(
          "attention B=%lld T=%lld H=%lld D=%lld %s, sliding window %lld (generic kernels): "
          "forward %.3f ms, backward %.3f ms\n",
          static_cast<long long>(batch), static_cast<long long>(seq), static_cast<long long>(heads),
          static_cast<long long>(head_dim), dt == DType::kBF16 ? "bf16" : "fp16",
          static_cast<long long>(window.window), fwd, bwd);
    }
  }
  return 0;
}
