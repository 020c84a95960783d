#!/usr/bin/env bash
# Makes (once) and prints the path of the Python virtual environment of the
# tests against transformers and PEFT: Debian's python3, no system site
# packages, the exact versions of scripts/requirements-hf.txt from PyPI.
# The environment lives outside the clone, at $AMPD_PYENV or at
# ~/.cache/ampd/pyenv-<hash of the requirements file>, so that every clone
# and every CI run on a machine reuses it; a half-made one (no .complete
# marker) is made again. stdout: the environment's directory, nothing else.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
requirements="$here/requirements-hf.txt"
hash="$(sha256sum "$requirements" | cut -c1-16)"
env_dir="${AMPD_PYENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ampd/pyenv-$hash}"
python="${AMPD_PYENV_PYTHON:-/usr/bin/python3}"

ready() { [[ -f "$env_dir/.complete" ]] && cmp -s "$requirements" "$env_dir/.complete"; }
if ready; then
  echo "$env_dir"
  exit 0
fi
# One maker at a time (CTest runs the suites that need it in parallel).
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
flock 9
if ready; then
  echo "$env_dir"
  exit 0
fi

start=$(date +%s)
echo "python-env: making $env_dir from $requirements" >&2
rm -rf "$env_dir"
"$python" -m venv "$env_dir" >&2
"$env_dir/bin/python" -m pip install --quiet pip==26.3 >&2
"$env_dir/bin/python" -m pip install --quiet --progress-bar off -r "$requirements" >&2
# What the tests import (the ampd package's stubs, from Debian's protoc
# 3.21, import under the pinned protobuf runtime: checked by the tests).
"$env_dir/bin/python" -c "import torch, transformers, peft, safetensors, numpy, grpc, google.protobuf" >&2
cp "$requirements" "$env_dir/.complete"
echo "python-env: made in $(( $(date +%s) - start )) s" >&2
echo "$env_dir"
