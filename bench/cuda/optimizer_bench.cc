// ampd_bench_cuda_optimizer: effective bandwidth of the fused AdamW step
// (fp16 scaled grads, fp32 master / m / v, fp16 working copy recast in the
// same kernel) next to the device's measured cudaMemcpy device-to-device
// bandwidth, the practical ceiling for a memory-bound kernel.
//
// Bytes moved per parameter per step (the figure GB/s is computed from):
//   read  grad 2 (fp16) + master 4 + m 4 + v 4      = 14
//   write master 4 + m 4 + v 4 + working 2 (fp16)  = 14
//   total 28 bytes/param (found_inf and norm_sq are two 4-byte scalars).
// A memcpy of B bytes moves 2B (read + write), counted the same way.
//
// Usage: ampd_bench_cuda_optimizer [total_params_millions=256] [runs=20]
// Prints the median over `runs` timed steps after warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"

namespace {

using ampd::bench::MeasureMemcpy;
using ampd::bench::Median;
using ampd::kernels::AdamConfig;
using ampd::kernels::Backend;
using ampd::kernels::DType;
using ampd::kernels::GradTransform;
using ampd::kernels::ParamRef;
using ampd::kernels::Tensor;

constexpr double kBytesPerParam = 28.0;

}  // namespace

int main(int argc, char** argv) {
  if (ampd::kernels::CudaDeviceCount() == 0) {
    std::fprintf(stderr,
                 "ampd_bench_cuda_optimizer: no CUDA device visible; this benchmark needs a GPU\n");
    return 1;
  }
  const double millions = argc > 1 ? std::atof(argv[1]) : 256.0;
  const int runs = argc > 2 ? std::max(1, std::atoi(argv[2])) : 20;
  if (!(millions > 0)) {
    std::fprintf(stderr, "usage: %s [total_params_millions>0] [runs]\n", argv[0]);
    return 2;
  }
  auto backend_or = ampd::kernels::CreateBackend("cuda:0");
  if (!backend_or.ok()) {
    std::fprintf(stderr, "cannot create cuda:0: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  Backend& b = **backend_or;

  // A layer-like mix: 1024x1024 weight matrices and their 1024 biases, the
  // shape of the reference MLP, repeated to reach the requested size.
  const int64_t total = static_cast<int64_t>(millions * 1e6);
  const int64_t per_layer = 1024 * 1024 + 1024;
  const int64_t layers = std::max<int64_t>(1, total / per_layer);
  struct Param {
    Tensor master, working, grad, m, v;
  };
  std::vector<Param> params;
  auto check = [](const absl::Status& s, const char* what) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
      std::exit(1);
    }
  };
  auto alloc = [&](DType dt, int64_t n, float fill) {
    auto t = b.Allocate(dt, {n});
    check(t.status(), "Allocate");
    check(b.Fill(*t, fill), "Fill");
    return *std::move(t);
  };
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t n : {int64_t{1024} * 1024, int64_t{1024}}) {
      params.push_back(Param{alloc(DType::kF32, n, 0.01f), alloc(DType::kF16, n, 0.01f),
                             alloc(DType::kF16, n, 3.0f), alloc(DType::kF32, n, 0.0f),
                             alloc(DType::kF32, n, 0.0f)});
    }
  }
  std::vector<ParamRef> refs;
  int64_t n_params = 0;
  for (Param& p : params) {
    refs.push_back(ParamRef{&p.master, &p.working, &p.grad, &p.m, &p.v});
    n_params += p.master.numel();
  }
  Tensor found_inf = alloc(DType::kF32, 1, 0.0f);
  Tensor norm_sq = alloc(DType::kF32, 1, 1e4f);
  const GradTransform transform{1.0f / 1024, &found_inf, &norm_sq, 1.0f};
  AdamConfig config;
  config.weight_decay = 0.01f;

  // Two clocks: the host's around the call and its wait (what a step pays,
  // launches included), and device events on the backend's stream around
  // the kernels alone (how the copy bandwidth below is timed too).
  auto* stream = static_cast<cudaStream_t>(b.native_stream().stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    std::fprintf(stderr, "cudaEventCreate failed\n");
    return 1;
  }
  std::vector<double> seconds, device_seconds;
  for (int i = 0; i < runs + 3; ++i) {  // 3 warm-up steps
    const auto t0 = std::chrono::steady_clock::now();
    if (cudaEventRecord(start, stream) != cudaSuccess) return 1;
    check(b.AdamUpdate(refs, config, i + 1, transform), "AdamUpdate");
    if (cudaEventRecord(stop, stream) != cudaSuccess) return 1;
    check(b.Synchronize(), "Synchronize");
    const auto t1 = std::chrono::steady_clock::now();
    float ms = 0;
    if (cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) return 1;
    if (i >= 3) {
      seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
      device_seconds.push_back(ms * 1e-3);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double step_s = Median(seconds);
  const double device_s = Median(device_seconds);
  const double adam_gbps = kBytesPerParam * static_cast<double>(n_params) / step_s / 1e9;
  const double device_gbps = kBytesPerParam * static_cast<double>(n_params) / device_s / 1e9;

  double copy_gbps = 0;
  const size_t copy_bytes = size_t{1} << 30;
  if (!MeasureMemcpy(copy_bytes, runs, &copy_gbps)) {
    std::fprintf(stderr, "cudaMemcpy D2D measurement failed: %s\n",
                 cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s\n", prop.name);
  std::printf("fused AdamW step: %.1f M params in %zu tensors, %.0f bytes/param\n",
              static_cast<double>(n_params) / 1e6, params.size(), kBytesPerParam);
  std::printf("  median step %.3f ms over %d runs (host-timed, includes launch + sync)\n",
              step_s * 1e3, runs);
  std::printf("  effective bandwidth  %.1f GB/s\n", adam_gbps);
  std::printf("  kernels alone (device events): median %.3f ms, %.1f GB/s\n", device_s * 1e3,
              device_gbps);
  std::printf("cudaMemcpy D2D (1 GiB, read+write): %.1f GB/s\n", copy_gbps);
  std::printf("AdamW / memcpy: %.1f%% host-timed, %.1f%% device-timed\n",
              100.0 * adam_gbps / copy_gbps, 100.0 * device_gbps / copy_gbps);
  return 0;
}
