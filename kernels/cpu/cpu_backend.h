// The CPU backend: the bit-faithful reference every other backend is tested
// against. fp16/bf16 tensors hold raw bits (uint16_t) and every store rounds
// with kernels/float16.h; fp32 GEMM goes to OpenBLAS.
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace ampd::kernels {

std::unique_ptr<Backend> CreateCpuBackend();

}  // namespace ampd::kernels
