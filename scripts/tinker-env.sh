#!/usr/bin/env bash
# Makes (once) and prints the path of the Python virtual environment of
# ampd-tinker and its tests (pyenv-lib.sh's make_pyenv): the exact versions
# of scripts/requirements-tinker.txt (the newest tinker SDK served among
# them), and the older SDK tested beside it in <env>/sdk-$TINKER_OLDER (that
# version alone, --no-deps: it runs on the same dependencies; put it first
# on PYTHONPATH to use it). The environment lives outside the clone, at
# $AMPD_TINKER_PYENV or at ~/.cache/ampd/tinker-env-<hash>, so that every
# clone and CI run on a machine reuses it.
# stdout: the environment's directory, nothing else.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/pyenv-lib.sh"
requirements="$here/requirements-tinker.txt"
TINKER_OLDER=0.25.0
hash="$( (cat "$requirements"; echo "$TINKER_OLDER") | sha256sum | cut -c1-16)"
env_dir="${AMPD_TINKER_PYENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ampd/tinker-env-$hash}"

install_older_sdk() {
  "$1/bin/python" -m pip install --quiet --progress-bar off --no-deps \
    --target "$1/sdk-$TINKER_OLDER" "tinker==$TINKER_OLDER"
  echo "$TINKER_OLDER" > "$1/older-sdk"
}
make_pyenv tinker-env "$env_dir" "$requirements" \
  "aiohttp, grpc, google.protobuf, numpy, zstandard, tinker, tokenizers" install_older_sdk
