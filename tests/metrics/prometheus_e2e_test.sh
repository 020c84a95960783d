#!/usr/bin/env bash
# End to end through a real Prometheus: starts Debian's `prometheus` on a free
# loopback port with a throwaway config that scrapes one metrics endpoint the
# way deploy/prometheus/prometheus.yml does (honor_labels, so ampd's job
# label survives), waits until Prometheus is ready and has scraped
# ampd_loss_scale, and checks the value. Every wait polls a condition under a
# deadline.
#
#   prometheus_e2e_test.sh --metrics-url http://HOST:PORT/metrics --expect-loss-scale 32768 \
#       [--job JOB_ID] [--prometheus /usr/bin/prometheus] [--timeout SECONDS]
#   prometheus_e2e_test.sh --fixture-server build/.../metrics_fixture_server --expect-loss-scale 32768 ...
#
# --metrics-url points it at a live ampd (--metrics-listen); --fixture-server
# starts tests/metrics/metrics_fixture_server and scrapes that instead. With
# --job, the series of that training job must hold the value; without it,
# some ampd_loss_scale series must.
set -euo pipefail

metrics_url=""
fixture_server=""
expected=""
job_id=""
prometheus_bin="prometheus"
timeout_s=60

die() {
  echo "prometheus_e2e_test: FAIL: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --metrics-url) metrics_url="$2"; shift 2 ;;
    --fixture-server) fixture_server="$2"; shift 2 ;;
    --expect-loss-scale) expected="$2"; shift 2 ;;
    --job) job_id="$2"; shift 2 ;;
    --prometheus) prometheus_bin="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[ -n "$expected" ] || die "--expect-loss-scale is required"
if [ -z "$metrics_url" ] && [ -z "$fixture_server" ]; then
  die "one of --metrics-url or --fixture-server is required"
fi
command -v "$prometheus_bin" > /dev/null || die "prometheus binary '$prometheus_bin' not found (scripts/install-deps.sh installs it)"
command -v curl > /dev/null || die "curl not found"
command -v python3 > /dev/null || die "python3 not found"

workdir="$(mktemp -d "${TMPDIR:-/tmp}/ampd_prom_e2e.XXXXXX")"
prom_pid=""
fixture_pid=""
fixture_in_fd=""
# shellcheck disable=SC2317  # invoked through the EXIT trap
cleanup() {
  # Only the processes this script started, by pid.
  if [ -n "$prom_pid" ]; then
    kill "$prom_pid" 2> /dev/null || true
    wait "$prom_pid" 2> /dev/null || true
  fi
  if [ -n "$fixture_pid" ]; then
    # Closing its stdin is the fixture's stop signal; SIGTERM only when it
    # has not exited within a bounded wait.
    if [ -n "$fixture_in_fd" ]; then exec {fixture_in_fd}>&-; fi
    local stop_deadline=$((SECONDS + 10))
    while kill -0 "$fixture_pid" 2> /dev/null && [ "$SECONDS" -lt "$stop_deadline" ]; do
      sleep 0.1
    done
    kill "$fixture_pid" 2> /dev/null || true
    wait "$fixture_pid" 2> /dev/null || true
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT

deadline=$((SECONDS + timeout_s))

if [ -n "$fixture_server" ]; then
  # The fixture prints its port, then serves until its stdin closes; a FIFO
  # held open by this shell is that stdin, and the pid is the server's own.
  mkfifo "$workdir/fixture_in" "$workdir/fixture_out"
  "$fixture_server" 127.0.0.1:0 < "$workdir/fixture_in" > "$workdir/fixture_out" &
  fixture_pid=$!
  exec {fixture_in_fd}> "$workdir/fixture_in"
  exec {fixture_out_fd}< "$workdir/fixture_out"
  fixture_port=""
  read -r -t "$timeout_s" fixture_port <&"$fixture_out_fd" || die "metrics_fixture_server printed no port"
  [[ "$fixture_port" =~ ^[0-9]+$ ]] || die "metrics_fixture_server printed '$fixture_port', not a port"
  metrics_url="http://127.0.0.1:${fixture_port}/metrics"
fi

[[ "$metrics_url" =~ ^(https?)://([^/]+)(/.*)?$ ]] || die "cannot parse metrics URL '$metrics_url'"
scheme="${BASH_REMATCH[1]}"
target="${BASH_REMATCH[2]}"
metrics_path="${BASH_REMATCH[3]:-/metrics}"

cat > "$workdir/prometheus.yml" << EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: ampd
    honor_labels: true
    scheme: $scheme
    metrics_path: $metrics_path
    static_configs:
      - targets: ["$target"]
EOF

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The free port can be taken between the probe and Prometheus's bind: retry a
# few times when Prometheus exits before it is ready.
prom_port=""
for attempt in 1 2 3; do
  prom_port="$(free_port)"
  "$prometheus_bin" --config.file="$workdir/prometheus.yml" \
    --storage.tsdb.path="$workdir/data.$attempt" \
    --web.listen-address="127.0.0.1:$prom_port" \
    --log.level=warn > "$workdir/prometheus.$attempt.log" 2>&1 &
  prom_pid=$!
  ready=0
  while [ "$SECONDS" -lt "$deadline" ]; do
    if curl -fsS -o /dev/null "http://127.0.0.1:$prom_port/-/ready" 2> /dev/null; then
      ready=1
      break
    fi
    kill -0 "$prom_pid" 2> /dev/null || break  # exited: probably lost the port
    sleep 0.2
  done
  if [ "$ready" = 1 ]; then break; fi
  wait "$prom_pid" 2> /dev/null || true
  prom_pid=""
  echo "prometheus_e2e_test: Prometheus attempt $attempt did not become ready:" >&2
  cat "$workdir/prometheus.$attempt.log" >&2
  [ "$SECONDS" -lt "$deadline" ] || break
done
[ -n "$prom_pid" ] || die "Prometheus never became ready"
echo "prometheus_e2e_test: Prometheus ready on 127.0.0.1:$prom_port, scraping $metrics_url"

if [ -n "$job_id" ]; then
  query="ampd_loss_scale{job=\"$job_id\"}"
else
  query="ampd_loss_scale"
fi

# Prints "ok <values>" when some returned series equals the expected value,
# "wait <values>" otherwise (no sample yet, or a different value).
check_query() {
  python3 -c '
import json, math, sys
expected = float(sys.argv[1])
body = json.load(sys.stdin)
if body.get("status") != "success":
    print("wait query-error:" + str(body.get("error")))
    sys.exit(0)
values = [float(r["value"][1]) for r in body["data"]["result"]]
ok = any(math.isclose(v, expected, rel_tol=0, abs_tol=1e-9) for v in values)
print(("ok " if ok else "wait ") + ",".join(repr(v) for v in values))
' "$expected"
}

last=""
while [ "$SECONDS" -lt "$deadline" ]; do
  if body="$(curl -fsS -G "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$query" 2> /dev/null)"; then
    last="$(printf '%s' "$body" | check_query)"
    if [[ "$last" == ok* ]]; then
      echo "prometheus_e2e_test: PASS: $query = ${last#ok } (expected $expected)"
      exit 0
    fi
  fi
  sleep 0.2
done

echo "prometheus_e2e_test: last query result: ${last:-none}" >&2
echo "prometheus_e2e_test: scrape targets:" >&2
curl -fsS "http://127.0.0.1:$prom_port/api/v1/targets" >&2 || true
echo >&2
die "$query never equalled $expected within ${timeout_s}s"
