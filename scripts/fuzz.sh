#!/usr/bin/env bash
# Builds the libFuzzer targets (the `fuzz` preset: clang, ASan + UBSan, CPU
# only) and runs them.
#   scripts/fuzz.sh                    every target for 100,000 inputs (CI's run)
#   scripts/fuzz.sh TARGET [SECONDS]   one target for SECONDS (default: until
#                                      Ctrl-C), growing its corpus in
#                                      build/fuzz/tests/fuzz/corpus/TARGET
# Targets: safetensors, create_job, step, load_state, scaler_state, peer,
# json_value, hf_config. A crash leaves the input in the working directory
# as crash-<sha1>; rerun it with
#   build/fuzz/tests/fuzz/ampd_fuzz_TARGET crash-<sha1>
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target ampd_fuzzers -j "$(nproc)"
if [ $# -eq 0 ]; then
  exec ctest --preset fuzz -j "$(nproc)"
fi
target=$1
seconds=${2:-0}
corpus=build/fuzz/tests/fuzz/corpus
build/fuzz/tests/fuzz/ampd_fuzz_seeds "$corpus"
exec "build/fuzz/tests/fuzz/ampd_fuzz_$target" -max_total_time="$seconds" \
  -malloc_limit_mb=512 -rss_limit_mb=2048 -timeout=30 -max_len=65536 "$corpus/$target"
