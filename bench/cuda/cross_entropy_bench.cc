// ampd_bench_cuda_cross_entropy: time per call of the cross-entropy ops at
// the LM-head shapes of the GPT and token models, next to the device's
// measured cudaMemcpy device-to-device bandwidth, the practical ceiling for
// these memory-bound kernels.
//
// Bytes per call: the (N, V) logits read once and the gradient written once
// (in place, as the GPT step does): 2 N V sizeof(dtype). "x 1-pass" is the
// time over that traffic at memcpy bandwidth; "x 2-pass" over the traffic
// of a kernel that reads the logits twice (3 N V sizeof(dtype)).
//
// Usage: ampd_bench_cuda_cross_entropy [runs=20]
// Prints the median over `runs` timed batches of 5 calls after warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench/cuda/bench_common.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"

namespace {

using ampd::bench::Check;
using ampd::bench::MeasureMemcpy;
using ampd::bench::Median;
using ampd::kernels::Backend;
using ampd::kernels::DType;
using ampd::kernels::Tensor;

struct Shape {
  const char* name;
  bool chunk;  // CrossEntropyChunk in place, else CrossEntropyLoss
  DType dtype;
  int64_t rows, vocab;
};

}  // namespace

int main(int argc, char** argv) {
  if (ampd::kernels::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "ampd_bench_cuda_cross_entropy: no CUDA device visible\n");
    return 1;
  }
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  auto backend_or = ampd::kernels::CreateBackend("cuda:0");
  if (!backend_or.ok()) {
    std::fprintf(stderr, "cannot create cuda:0: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  Backend& b = **backend_or;
  double memcpy_gbps = 0;
  if (!MeasureMemcpy(size_t{1} << 30, runs, &memcpy_gbps)) {
    std::fprintf(stderr, "memcpy bandwidth measurement failed\n");
    return 1;
  }
  std::printf("memcpy D2D: %.0f GB/s (read + write)\n", memcpy_gbps);
  std::printf("%-34s %9s %9s %9s %9s\n", "op", "ms/call", "GB/s", "x 1-pass", "x 2-pass");

  const Shape shapes[] = {
      {"chunk bf16 8192 x 50304 (GPT-2)", true, DType::kBF16, 8192, 50304},
      {"chunk fp16 8192 x 50304", true, DType::kF16, 8192, 50304},
      {"loss  fp16 8192 x 32768 (token)", false, DType::kF16, 8192, 32768},
      {"loss  bf16 8192 x 50304", false, DType::kBF16, 8192, 50304},
      {"chunk fp32 2048 x 50304", true, DType::kF32, 2048, 50304},
      {"chunk bf16 1024 x 128256", true, DType::kBF16, 1024, 128256},
  };
  for (const Shape& s : shapes) {
    auto logits = b.Allocate(s.dtype, {s.rows, s.vocab});
    auto dlogits = b.Allocate(s.dtype, {s.rows, s.vocab});
    auto labels = b.Allocate(DType::kI32, {s.rows});
    auto loss = b.Allocate(DType::kF32, {1});
    Check(logits.status(), "Allocate");
    Check(dlogits.status(), "Allocate");
    Check(labels.status(), "Allocate");
    Check(loss.status(), "Allocate");
    ampd::kernels::RandomFill fill;
    fill.distribution = ampd::kernels::RandomDistribution::kNormal;
    fill.stddev = 2.0f;
    fill.seed = 1234;
    // FillRandom writes F32 alone: 16-bit logits are drawn in F32 and cast.
    if (s.dtype == DType::kF32) {
      Check(b.FillRandom(*logits, fill), "FillRandom");
    } else {
      auto drawn = b.Allocate(DType::kF32, {s.rows, s.vocab});
      Check(drawn.status(), "Allocate");
      Check(b.FillRandom(*drawn, fill), "FillRandom");
      Check(b.Cast(*drawn, *logits), "Cast");
    }
    std::vector<int32_t> ids(static_cast<size_t>(s.rows));
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int32_t>((i * 7919) % static_cast<size_t>(s.vocab));
    }
    Check(b.CopyFromHost(ids.data(), ids.size() * sizeof(int32_t), *labels), "CopyFromHost");
    Check(b.Fill(*loss, 0.0f), "Fill");
    auto call = [&] {
      if (s.chunk) {
        // In place, as the GPT step: the logits become their gradient.
        return b.CrossEntropyChunk(*logits, *labels, -100, 1e-4f, 1e-4f, *loss, *logits);
      }
      return b.CrossEntropyLoss(*logits, *labels, 1.0f, 1.0f, *loss, *dlogits);
    };
    std::vector<double> per_call;
    for (int i = 0; i < runs + 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < 5; ++k) Check(call(), "cross-entropy");
      Check(b.Synchronize(), "Synchronize");
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 2) per_call.push_back(std::chrono::duration<double>(t1 - t0).count() / 5);
    }
    const double sec = Median(per_call);
    const double bytes =
        static_cast<double>(s.rows * s.vocab) * static_cast<double>(ampd::kernels::SizeOf(s.dtype));
    const double one_pass = 2.0 * bytes / (memcpy_gbps * 1e9);
    std::printf("%-34s %9.3f %9.0f %9.2f %9.2f\n", s.name, sec * 1e3, 2.0 * bytes / sec / 1e9,
                sec / one_pass, sec / (1.5 * one_pass));
  }
  return 0;
}
