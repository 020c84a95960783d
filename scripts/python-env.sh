#!/usr/bin/env bash
# Makes (once) and prints the path of the Python virtual environment of the
# tests against transformers and PEFT: the exact versions of
# scripts/requirements-hf.txt (pyenv-lib.sh's make_pyenv). It lives outside
# the clone, at $AMPD_PYENV or at ~/.cache/ampd/pyenv-<hash of the
# requirements file>, so that every clone and every CI run on a machine
# reuses it. stdout: the environment's directory, nothing else.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/pyenv-lib.sh"
requirements="$here/requirements-hf.txt"
hash="$(sha256sum "$requirements" | cut -c1-16)"
env_dir="${AMPD_PYENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ampd/pyenv-$hash}"
# What the tests import (the ampd package's stubs, from Debian's protoc
# 3.21, import under the pinned protobuf runtime: checked by the tests).
make_pyenv python-env "$env_dir" "$requirements" \
  "torch, transformers, peft, safetensors, numpy, grpc, google.protobuf"
