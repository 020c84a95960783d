#!/usr/bin/env bash
# gpu-pack.sh: packs a build tree for a lent GPU machine with exactly what
# scripts/gpu-check.sh runs (../shared/tools/gpu-bundle, told which
# executables): ampd, ampctl, the benchmarks, the CUDA suites, the sampler's
# and the backend's op tests, and the engine's CUDA and sampling tests. The
# gtest lists are written first (ctest -N), as gpu-bundle asks.
#   scripts/gpu-pack.sh [build/ci]
# then, on the GPU machine: bash .gpu/run scripts/gpu-check.sh --out="$OUT" --pack
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="${1:-build/ci}"
bundle="${GPU_BUNDLE:-$root/../shared/tools/gpu-bundle}"
[ -x "$bundle" ] || { echo "gpu-pack: no gpu-bundle at $bundle (set GPU_BUNDLE)" >&2; exit 2; }
ctest --test-dir "$build" -N >/dev/null
GPU_BUNDLE_ONLY="^$build/(server/ampd|client/ampctl|bench/|tests/cuda/|tests/kernels/(backend_ops|sample_ops)_test|tests/engine/engine_(cuda_training|sample)_test)" \
  exec "$bundle" "$build"
