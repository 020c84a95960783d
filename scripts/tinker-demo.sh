#!/usr/bin/env bash
# The Tinker demo in one command: build ampd and the front's packages, make a
# tiny Qwen2-family base folder, start ampd and ampd-tinker on free loopback
# ports, make the Python environment with the tinker SDK from PyPI
# (scripts/tinker-env.sh, reused once made), and run examples/tinker_rl.py
# (a GRPO-like loop written against the SDK alone) in fp16. Exits 0 only when
# the reward rose and the sampler/trainer mismatch was 0 on every iteration.
# AMPD_BUILD_DIR: an existing build tree to use (default: preset cpu, or dev
# where a GPU answers, as scripts/demo.sh).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [[ -n "${AMPD_BUILD_DIR:-}" ]]; then
  bin="$AMPD_BUILD_DIR"
else
  scripts/install-deps.sh
  preset=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then preset=dev; fi
  bin="build/$preset"
  cmake --preset "$preset" >/dev/null
fi
echo "tinker-demo: building ampd and the Python packages in $bin"
cmake --build "$bin" -j"$(nproc)" --target ampd ampd_python_package ampd_tinker_package
env_dir="$(scripts/tinker-env.sh)"
python="$env_dir/bin/python"

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Wait (bounded) for "NAME: listening on 127.0.0.1:PORT" in a file; prints PORT.
port_of() {
  local name="$1" file="$2" pid="$3" port=""
  for _ in $(seq 600); do
    port="$(sed -n "s/^$name: listening on 127\.0\.0\.1:\([0-9]*\)\$/\1/p" "$file")"
    [[ -n "$port" ]] && { echo "$port"; return 0; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "tinker-demo: $name did not start" >&2
  cat "$work/$name.log" >&2
  return 1
}

"$python" tinker_front/tests/tiny_base.py "$work/models" tiny/qwen2-chars >/dev/null
: >"$work/ampd.out"
"$bin"/server/ampd --listen=127.0.0.1:0 --metrics-listen= --device=auto \
  >"$work/ampd.out" 2>"$work/ampd.log" &
pids+=($!)
ampd_port="$(port_of ampd "$work/ampd.out" "${pids[-1]}")"

: >"$work/ampd-tinker.out"
AMPD_BUILD_DIR="$bin" AMPD_TINKER_PYTHON="$python" tinker_front/ampd-tinker \
  --ampd="127.0.0.1:$ampd_port" --listen=127.0.0.1:0 --precision=fp16 \
  --models-dir="$work/models" --state-dir="$work/front-state" \
  >"$work/ampd-tinker.out" 2>"$work/ampd-tinker.log" &
pids+=($!)
front_port="$(port_of ampd-tinker "$work/ampd-tinker.out" "${pids[-1]}")"
echo "tinker-demo: ampd on 127.0.0.1:$ampd_port, ampd-tinker on http://127.0.0.1:$front_port"

status=0
TINKER_API_KEY=tml-tinker-demo "$python" examples/tinker_rl.py \
  --base-url "http://127.0.0.1:$front_port" --base-model tiny/qwen2-chars --check || status=$?
echo "tinker-demo: examples/tinker_rl.py exited with status $status"
exit "$status"
