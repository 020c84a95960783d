#!/usr/bin/env bash
# The README's main command: install the dependencies, build ampd and ampctl,
# start ampd on a free loopback port, train a small fp16 job with dynamic loss
# scaling (the first steps overflow at init_scale 65536 and the scale backs
# off, then grows every --growth-interval good steps), and stop ampd with
# SIGTERM, waiting for its graceful exit (final checkpoint, exit 0).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

scripts/install-deps.sh
# Compiling the CUDA kernels for two GPU generations is most of a fresh
# build, and without a GPU ampd trains on the CPU backend anyway: the CUDA
# backend is built only where a GPU answers.
preset=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then preset=dev; fi
bin="build/$preset"
echo "demo: building ampd and ampctl (preset $preset)"
cmake --preset "$preset" >/dev/null
cmake --build "$bin" -j"$(nproc)" --target ampd ampctl

work="$(mktemp -d)"
ampd_pid=""
cleanup() {
  if [ -n "$ampd_pid" ] && kill -0 "$ampd_pid" 2>/dev/null; then kill -KILL "$ampd_pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT

# ampd.out exists before ampd starts: its redirect runs in the forked child,
# which may not have run when the loop first reads it.
: >"$work/ampd.out"
"$bin"/server/ampd --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --device=auto \
  --state-dir="$work/state" --checkpoint-every=20 >"$work/ampd.out" 2>"$work/ampd.log" &
ampd_pid=$!

# Wait (bounded) for the "ampd: listening on HOST:PORT" line.
port=""
for _ in $(seq 300); do
  port="$(sed -n 's/^ampd: listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$work/ampd.out")"
  [ -n "$port" ] && break
  kill -0 "$ampd_pid" 2>/dev/null || { cat "$work/ampd.log"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { echo "demo: ampd did not start"; cat "$work/ampd.log"; exit 1; }
metrics="$(sed -n 's/^ampd: metrics on \(.*\)$/\1/p' "$work/ampd.out")"
echo "demo: ampd on 127.0.0.1:$port (metrics http://$metrics/metrics)"

"$bin"/client/ampctl --server="127.0.0.1:$port" health
"$bin"/client/ampctl --server="127.0.0.1:$port" train --precision=fp16 --steps=60 \
  --scaler=pytorch --growth-interval=10 --lr=0.01 --seed=1

echo "demo: stopping ampd (SIGTERM)"
kill -TERM "$ampd_pid"
status=0
wait "$ampd_pid" || status=$?
ampd_pid=""
cat "$work/ampd.log"
echo "demo: ampd exited with status $status"
exit "$status"
