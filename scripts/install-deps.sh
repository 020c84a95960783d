#!/usr/bin/env bash
# Installs the Debian packages ampd builds, tests and runs with. Idempotent:
# packages already present are left alone, and apt is not touched at all when
# nothing is missing. Works as root or through sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libopenblas-dev
  libssl-dev  # libcrypto: SHA-256 and constant-time compare of bearer tokens
  libgloo-dev  # Gloo: data-parallel jobs' collectives across ampd replicas
  openssl  # tests/service/security_test.cc makes its certificates with it
  prometheus  # promtool and a real Prometheus for the metrics tests
  python3-yaml  # tests/metrics/validate_deploy.py parses the compose and k8s YAML
  python3-grpcio python3-protobuf  # Python clients of the generated stubs (tests/python)
  python3-numpy python3-pytest  # the ampd Python package (client/python) and its tests
  python3-venv python3-pip python3-setuptools python3-wheel  # its pip install / wheel tests
  python3-torch  # ampd.torch interop tests (they skip, saying so, without it)
  curl
  clang libclang-rt-14-dev  # libFuzzer, ASan and UBSan for scripts/fuzz.sh
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
echo "install-deps: installing ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
