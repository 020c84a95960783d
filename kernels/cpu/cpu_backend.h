// The CPU backend: the bit-faithful reference every other backend is tested
// against. fp16/bf16 tensors hold raw bits (uint16_t) and every store rounds
// with kernels/float16.h; fp32 GEMM goes to OpenBLAS, or in batch-invariant
// mode (Backend::SetBatchInvariant) to kernels/cpu/gemm_invariant.cc.
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace ampd::kernels {

// A backend whose ops split their work over ThreadPool::DefaultThreads()
// threads, or over `threads` (>= 1). Results are the same bits whatever
// the thread count.
std::unique_ptr<Backend> CreateCpuBackend();
std::unique_ptr<Backend> CreateCpuBackend(int threads);

}  // namespace ampd::kernels
