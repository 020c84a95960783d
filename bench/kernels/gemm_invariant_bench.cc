// What batch-invariant GEMMs cost on the CPU backend: median wall time of
// Backend::Gemm with the mode off (OpenBLAS) and on (kernels/cpu/
// gemm_invariant.cc), a Linear's forward c = x @ W^T (trans_b), on the
// backend's default pool (AMPD_CPU_THREADS). OpenBLAS threads itself: run
// with OPENBLAS_NUM_THREADS=1 AMPD_CPU_THREADS=1 for a single-thread figure. Shapes: a
// prefill-sized batch (M = 8192, K = N = 896) and a sampling step's few rows against a wide MLP
// weight (M = 16, K = 896, N = 4864). Prints; never passes or fails.
//
//   ampd_bench_gemm_invariant [--reps=N] [--dtype=f32|bf16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_parallel.h"

namespace ampd::kernels {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random operands in dtype: F32 as is, BF16 as the top half of the fp32 bits
// (the values need not be exact here, only the same for both modes).
Tensor Random(Backend& be, DType dtype, const Shape& shape, std::mt19937_64& rng) {
  Tensor t = be.Allocate(dtype, shape).value();
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(t.numel()));
  for (float& v : values) v = dist(rng);
  if (dtype == DType::kF32) {
    (void)be.CopyFromHost(values.data(), t.nbytes(), t);
  } else {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      bits[i] = static_cast<uint16_t>(u >> 16);
    }
    (void)be.CopyFromHost(bits.data(), t.nbytes(), t);
  }
  return t;
}

// Median seconds of `reps` calls (after one warm-up) of c = a @ b^T.
double Time(Backend& be, Tensor& a, Tensor& b, Tensor& c, int reps) {
  (void)be.Gemm(false, true, 1.0f, a, b, 0.0f, c);
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const Clock::time_point t0 = Clock::now();
    const absl::Status s = be.Gemm(false, true, 1.0f, a, b, 0.0f, c);
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (!s.ok()) {
      std::fprintf(stderr, "Gemm: %s\n", std::string(s.message()).c_str());
      return 0.0;
    }
  }
  return Median(times);
}

int Main(int argc, char** argv) {
  int reps = 5;
  DType dtype = DType::kF32;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--reps=", 0) == 0 && absl::SimpleAtoi(arg.substr(7), &reps) && reps > 0) {
      continue;
    }
    if (arg == "--dtype=f32" || arg == "--dtype=bf16") {
      dtype = arg == "--dtype=f32" ? DType::kF32 : DType::kBF16;
      continue;
    }
    std::fprintf(stderr, "usage: %s [--reps=N] [--dtype=f32|bf16]\n", argv[0]);
    return 2;
  }
  struct Dims {
    int64_t m, k, n;
  };
  const char* blas_threads = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("dtype %s, %d reps, c = a @ b^T, OPENBLAS_NUM_THREADS=%s\n",
              std::string(DTypeName(dtype)).c_str(), reps,
              blas_threads != nullptr ? blas_threads : "(unset)");
  std::printf("%-22s %8s %14s %14s %8s\n", "M x K x N", "threads", "off (OpenBLAS)",
              "on (invariant)", "on/off");
  for (const Dims d : {Dims{8192, 896, 896}, Dims{16, 896, 4864}}) {
    {
      const int threads = cpu::ThreadPool::DefaultThreads();
      std::unique_ptr<Backend> be = CreateCpuBackend(threads);
      std::mt19937_64 rng(1);
      Tensor a = Random(*be, dtype, {d.m, d.k}, rng);
      Tensor b = Random(*be, dtype, {d.n, d.k}, rng);
      Tensor c = be->Allocate(dtype, {d.m, d.n}).value();
      const double off = Time(*be, a, b, c, reps);
      if (!be->SetBatchInvariant(true).ok()) return 1;
      const double on = Time(*be, a, b, c, reps);
      const std::string shape =
          std::to_string(d.m) + " x " + std::to_string(d.k) + " x " + std::to_string(d.n);
      const double flops = 2.0 * static_cast<double>(d.m * d.k * d.n);
      std::printf("%-22s %8d %8.2f ms %3.0fG %8.2f ms %3.0fG %7.2fx\n", shape.c_str(), threads,
                  off * 1e3, flops / off / 1e9, on * 1e3, flops / on / 1e9, on / off);
    }
  }
  return 0;
}

}  // namespace
}  // namespace ampd::kernels

int main(int argc, char** argv) { return ampd::kernels::Main(argc, argv); }
