#!/usr/bin/env bash
# The README's test command: install dependencies, configure and build with
# the CI preset (warnings are errors; the CUDA backend is compiled whenever
# nvcc is present), then run every test through CTest. GPU tests skip when no
# GPU is present. The tests against transformers and PEFT run in the pinned
# Python environment scripts/python-env.sh makes once per machine, and those
# of ampd-tinker with the tinker SDK in the one scripts/tinker-env.sh makes
# (both made here, before CTest, so that no test's time limit pays for them). Last, the fuzz
# targets run for a bounded number of inputs each (scripts/fuzz.sh; clang,
# ASan + UBSan).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/python-env.sh
./scripts/tinker-env.sh
cmake --preset ci
cmake --build --preset ci -j "$(nproc)"
ctest --preset ci -j "$(nproc)"
./scripts/fuzz.sh
