#!/usr/bin/env bash
# The README's test command: install dependencies, configure and build with
# the CI preset (warnings are errors; the CUDA backend is compiled whenever
# nvcc is present), then run every test through CTest. GPU tests skip when no
# GPU is present. Last, the fuzz targets run for a bounded number of inputs
# each (scripts/fuzz.sh; clang, ASan + UBSan).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake --preset ci
cmake --build --preset ci -j "$(nproc)"
ctest --preset ci -j "$(nproc)"
./scripts/fuzz.sh
