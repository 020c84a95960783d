#include "kernels/cpu/cpu_backend.h"
namespace ampd::kernels { std::unique_ptr<Backend> CreateCpuBackend() { return nullptr; } }
