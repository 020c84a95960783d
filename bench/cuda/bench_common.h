// What the GPU benchmarks share: the median of timed samples, an exit on a
// failed setup call, and the device-to-device copy bandwidth they report
// their kernels against (the practical ceiling of a memory-bound kernel).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/status/status.h"

namespace ampd::bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A benchmark's setup cannot fail quietly: the figures would be of nothing.
inline void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Device-to-device cudaMemcpy bandwidth (read + write bytes per second) of
// `bytes`, the median of `runs` after two warm-up copies, timed with events
// on a private stream. False when a CUDA call fails.
inline bool MeasureMemcpy(size_t bytes, int runs, double* gbps) {
  void* src = nullptr;
  void* dst = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  bool ok = cudaMalloc(&src, bytes) == cudaSuccess && cudaMalloc(&dst, bytes) == cudaSuccess &&
            cudaStreamCreate(&stream) == cudaSuccess && cudaEventCreate(&start) == cudaSuccess &&
            cudaEventCreate(&stop) == cudaSuccess && cudaMemset(src, 1, bytes) == cudaSuccess;
  std::vector<double> samples;
  for (int i = 0; ok && i < runs + 2; ++i) {
    float ms = 0;
    ok = cudaEventRecord(start, stream) == cudaSuccess &&
         cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess &&
         cudaEventRecord(stop, stream) == cudaSuccess &&
         cudaEventSynchronize(stop) == cudaSuccess &&
         cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
    if (ok && i >= 2) samples.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (stream) cudaStreamDestroy(stream);
  if (src) cudaFree(src);
  if (dst) cudaFree(dst);
  if (ok) *gbps = Median(samples);
  return ok;
}

}  // namespace ampd::bench
