#!/usr/bin/env bash
# A real Prometheus scraping a live ampd: starts ampd (--device=cpu, gRPC and
# metrics on free loopback ports), trains one fp16 step with `ampctl train`
# whose targets are far too large for fp16 at init scale 65536, so the scaler
# must back off to 32768, checks that in ampctl's own output and in
# `ampctl jobs list --json`, then runs tests/metrics/prometheus_e2e_test.sh
# against ampd's /metrics for that job, and finally stops ampd with SIGTERM,
# which must exit 0. Every wait polls a condition under a deadline.
#
#   live_prometheus_test.sh --ampd BUILD/server/ampd --ampctl BUILD/client/ampctl \
#       --prometheus-e2e tests/metrics/prometheus_e2e_test.sh [--prometheus /usr/bin/prometheus] \
#       [--timeout SECONDS]
set -euo pipefail

ampd_bin=""
ampctl_bin=""
prometheus_e2e=""
prometheus_bin="prometheus"
timeout_s=60
# 65536 is PyTorch's initial scale; one backoff (factor 0.5) halves it.
init_scale=65536
expected_scale=32768

die() {
  echo "live_prometheus_test: FAIL: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --ampd) ampd_bin="$2"; shift 2 ;;
    --ampctl) ampctl_bin="$2"; shift 2 ;;
    --prometheus-e2e) prometheus_e2e="$2"; shift 2 ;;
    --prometheus) prometheus_bin="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[ -x "$ampd_bin" ] || die "--ampd: '$ampd_bin' is not an executable"
[ -x "$ampctl_bin" ] || die "--ampctl: '$ampctl_bin' is not an executable"
[ -f "$prometheus_e2e" ] || die "--prometheus-e2e: '$prometheus_e2e' not found"
command -v python3 > /dev/null || die "python3 not found"

workdir="$(mktemp -d "${TMPDIR:-/tmp}/ampd_live_prom.XXXXXX")"
ampd_pid=""
# shellcheck disable=SC2317  # invoked through the EXIT trap
cleanup() {
  local rc=$?
  # Only the ampd this script started, by pid; a clean run has reaped it.
  if [ -n "$ampd_pid" ]; then
    kill -KILL "$ampd_pid" 2> /dev/null || true
    wait "$ampd_pid" 2> /dev/null || true
  fi
  if [ "$rc" != 0 ] && [ -f "$workdir/ampd.log" ]; then
    echo "live_prometheus_test: ampd log:" >&2
    cat "$workdir/ampd.log" >&2
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT

deadline=$((SECONDS + timeout_s))

# Port 0 for both: ampd binds free ports and prints them, so nothing can take
# a port between choosing it and binding it.
# The files exist before ampd starts: the redirects below run in the forked
# child, which may not have run when the loop first reads ampd.out.
: > "$workdir/ampd.out"
: > "$workdir/ampd.log"
"$ampd_bin" --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --device=cpu \
  --worker-threads=2 > "$workdir/ampd.out" 2> "$workdir/ampd.log" &
ampd_pid=$!

# main.cc flushes stdout after the listening line, which follows the metrics
# line: once the listening line is there, both are.
grpc_port=""
metrics_port=""
while [ "$SECONDS" -lt "$deadline" ]; do
  grpc_port="$(sed -n 's/^ampd: listening on 127\.0\.0\.1:\([0-9][0-9]*\)$/\1/p' "$workdir/ampd.out")"
  [ -n "$grpc_port" ] && break
  kill -0 "$ampd_pid" 2> /dev/null || die "ampd exited before listening"
  sleep 0.1
done
[ -n "$grpc_port" ] || die "ampd printed no listening line within ${timeout_s}s"
metrics_port="$(sed -n 's/^ampd: metrics on 127\.0\.0\.1:\([0-9][0-9]*\)$/\1/p' "$workdir/ampd.out")"
[ -n "$metrics_port" ] || die "ampd printed no metrics line: $(cat "$workdir/ampd.out")"
echo "live_prometheus_test: ampd on 127.0.0.1:$grpc_port, metrics on 127.0.0.1:$metrics_port"

# Targets of magnitude 1e4 make the MSE gradient at the output about 1e4 / 4
# per element, times 65536: far past fp16's 65504, so step 1 must overflow.
ampctl=("$ampctl_bin" --server="127.0.0.1:$grpc_port" --deadline-ms=20000)
"${ampctl[@]}" train --precision=fp16 --steps=1 --batch-size=16 --target-scale=10000 \
  --init-scale="$init_scale" --growth-interval=1000 --json > "$workdir/train.json" ||
  die "ampctl train failed"

# The job id and the step's outcome from ampctl's JSON line.
job_id="$(python3 - "$workdir/train.json" "$init_scale" "$expected_scale" << 'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.strip()]
if len(lines) != 1:
    sys.exit("expected one JSON line from ampctl train, got %d" % len(lines))
step = json.loads(lines[0])
want = {"step": 1, "skipped": True, "found_inf": True,
        "scale_before": float(sys.argv[2]), "loss_scale": float(sys.argv[3])}
for key, value in want.items():
    if step.get(key) != value:
        sys.exit("ampctl train: %s = %r, expected %r (%s)" % (key, step.get(key), value, lines[0]))
print(step["job_id"])
EOF
)" || die "the training step did not back off as forced"
[ -n "$job_id" ] || die "no job id in ampctl's output"

# The server's own view of the job agrees.
"${ampctl[@]}" jobs list --json > "$workdir/jobs.json" || die "ampctl jobs list failed"
python3 - "$workdir/jobs.json" "$job_id" "$expected_scale" << 'EOF' || die "ampctl jobs list disagrees"
import json, sys
jobs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
match = [j for j in jobs if j.get("job_id") == sys.argv[2]]
if len(match) != 1:
    sys.exit("job %s listed %d times in %r" % (sys.argv[2], len(match), jobs))
if float(match[0].get("loss_scale", 0)) != float(sys.argv[3]):
    sys.exit("job %s has loss_scale %r" % (sys.argv[2], match[0].get("loss_scale")))
EOF
echo "live_prometheus_test: job $job_id backed off to $expected_scale"

left=$((deadline - SECONDS))
[ "$left" -gt 0 ] || die "no time left for Prometheus"
bash "$prometheus_e2e" --metrics-url "http://127.0.0.1:$metrics_port/metrics" \
  --expect-loss-scale "$expected_scale" --job "$job_id" \
  --prometheus "$prometheus_bin" --timeout "$left" ||
  die "Prometheus did not see ampd_loss_scale{job=\"$job_id\"} = $expected_scale"

# Graceful shutdown: SIGTERM, a bounded wait for the exit, then its status.
kill -TERM "$ampd_pid"
while kill -0 "$ampd_pid" 2> /dev/null && [ "$SECONDS" -lt $((deadline + 30)) ]; do
  sleep 0.1
done
kill -0 "$ampd_pid" 2> /dev/null && die "ampd still running 30s past the deadline after SIGTERM"
ampd_rc=0
wait "$ampd_pid" || ampd_rc=$?
ampd_pid=""
[ "$ampd_rc" = 0 ] || die "ampd exited $ampd_rc after SIGTERM, expected 0"
echo "live_prometheus_test: PASS"
