// ampd_bench_cuda_gemm: what batch-invariant GEMMs cost on the GPU. Each
// Linear shape of GPT-2 small and Qwen2.5-0.5B (and their LM heads), at a
// training step's M = 8192 tokens and a sampling step's M = 16 rows, timed
// through Backend::Gemm with the mode off (cuBLAS) and on
// (kernels/cuda/gemm_invariant.cu), in bf16 (fp32 accumulation, a bf16 c)
// and for two shapes in fp32.
//
// Usage: ampd_bench_cuda_gemm [runs=10]
// Prints the median over `runs` timed batches of 3 calls after warm-up:
// ms per call and TFLOP/s (2 M N K per call) per path, and invariant/cuBLAS.
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
using ampd::bench::Median;
using ampd::kernels::Backend;
using ampd::kernels::DType;
using ampd::kernels::Tensor;

struct GemmShape {
  const char* name;
  DType dtype;
  int64_t k, n;
  bool trans_b;  // b stored (N, K), a Hugging Face Linear's weight; else (K, N)
};

// Seconds per call of c (m, n) = a (m, k) @ op(b).
double TimeGemm(Backend& b, const GemmShape& s, int64_t m, bool invariant, int runs) {
  Check(b.SetBatchInvariant(invariant), "SetBatchInvariant");
  auto a = b.Allocate(s.dtype, {m, s.k});
  auto w = b.Allocate(s.dtype,
                      s.trans_b ? ampd::kernels::Shape{s.n, s.k} : ampd::kernels::Shape{s.k, s.n});
  auto c = b.Allocate(s.dtype, {m, s.n});
  Check(a.status(), "Allocate");
  Check(w.status(), "Allocate");
  Check(c.status(), "Allocate");
  ampd::kernels::RandomFill fill;
  fill.distribution = ampd::kernels::RandomDistribution::kNormal;
  fill.stddev = 0.5f;
  fill.seed = 99;
  for (Tensor* t : {&*a, &*w}) {
    if (s.dtype == DType::kF32) {
      Check(b.FillRandom(*t, fill), "FillRandom");
      continue;
    }
    auto drawn = b.Allocate(DType::kF32, t->shape());  // FillRandom writes F32 alone
    Check(drawn.status(), "Allocate");
    Check(b.FillRandom(*drawn, fill), "FillRandom");
    Check(b.Cast(*drawn, *t), "Cast");
  }
  std::vector<double> per_call;
  for (int i = 0; i < runs + 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 3; ++k) Check(b.Gemm(false, s.trans_b, 1.0f, *a, *w, 0.0f, *c), "Gemm");
    Check(b.Synchronize(), "Synchronize");
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= 2) per_call.push_back(std::chrono::duration<double>(t1 - t0).count() / 3);
  }
  return Median(per_call);
}

}  // namespace

int main(int argc, char** argv) {
  if (ampd::kernels::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "ampd_bench_cuda_gemm: no CUDA device visible\n");
    return 1;
  }
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
  auto backend_or = ampd::kernels::CreateBackend("cuda:0");
  if (!backend_or.ok()) {
    std::fprintf(stderr, "cannot create cuda:0: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  Backend& b = **backend_or;
  const GemmShape shapes[] = {
      // GPT-2 small (C 768): Conv1D weights (in, out).
      {"gpt2 c_attn    768x2304", DType::kBF16, 768, 2304, false},
      {"gpt2 attn.proj 768x768", DType::kBF16, 768, 768, false},
      {"gpt2 c_fc      768x3072", DType::kBF16, 768, 3072, false},
      {"gpt2 mlp.proj  3072x768", DType::kBF16, 3072, 768, false},
      {"gpt2 lm_head   768x50304^T", DType::kBF16, 768, 50304, true},
      // Qwen2.5-0.5B (hidden 896, 2 K/V heads of 64, MLP 4864): (out, in).
      {"qwen q/o_proj  896x896^T", DType::kBF16, 896, 896, true},
      {"qwen k/v_proj  896x128^T", DType::kBF16, 896, 128, true},
      {"qwen gate/up   896x4864^T", DType::kBF16, 896, 4864, true},
      {"qwen down      4864x896^T", DType::kBF16, 4864, 896, true},
      {"qwen lm_head   896x151936^T", DType::kBF16, 896, 151936, true},
      // fp32 jobs: the SIMT kernel in the CPU oracle's order.
      {"gpt2 c_fc f32  768x3072", DType::kF32, 768, 3072, false},
      {"qwen down f32  4864x896^T", DType::kF32, 4864, 896, true},
  };
  std::printf("%-28s %5s %10s %8s %10s %8s %8s\n", "shape (K x N)", "M", "cuBLAS ms", "TFLOP/s",
              "invar. ms", "TFLOP/s", "ratio");
  for (const int64_t m : {int64_t{8192}, int64_t{16}}) {
    for (const GemmShape& s : shapes) {
      const double flop =
          2.0 * static_cast<double>(m) * static_cast<double>(s.n) * static_cast<double>(s.k);
      const double cublas = TimeGemm(b, s, m, false, runs);
      const double invariant = TimeGemm(b, s, m, true, runs);
      std::printf("%-28s %5lld %10.4f %8.1f %10.4f %8.1f %8.2f\n", s.name,
                  static_cast<long long>(m), cublas * 1e3, flop / cublas / 1e12, invariant * 1e3,
                  flop / invariant / 1e12, invariant / cublas);
    }
  }
  return 0;
}
