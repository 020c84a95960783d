#!/usr/bin/env bash
# Makes (once) and prints the path of the Python virtual environment of
# ampd-tinker and its tests: Debian's python3, no system site packages, the
# exact versions of scripts/requirements-tinker.txt from PyPI (the newest
# tinker SDK served among them), and the older SDK tested beside it in
# <env>/sdk-$TINKER_OLDER (that version alone, --no-deps: it runs on the same
# dependencies; put it first on PYTHONPATH to use it). The environment lives
# outside the clone, at $AMPD_TINKER_PYENV or at
# ~/.cache/ampd/tinker-env-<hash>, so that every clone and CI run on a
# machine reuses it; a half-made one (no .complete marker) is made again.
# stdout: the environment's directory, nothing else.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
requirements="$here/requirements-tinker.txt"
TINKER_OLDER=0.25.0
hash="$( (cat "$requirements"; echo "$TINKER_OLDER") | sha256sum | cut -c1-16)"
env_dir="${AMPD_TINKER_PYENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ampd/tinker-env-$hash}"
python="${AMPD_PYENV_PYTHON:-/usr/bin/python3}"

ready() { [[ -f "$env_dir/.complete" ]] && cmp -s "$requirements" "$env_dir/.complete"; }
if ready; then
  echo "$env_dir"
  exit 0
fi
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
flock 9
if ready; then
  echo "$env_dir"
  exit 0
fi

start=$(date +%s)
echo "tinker-env: making $env_dir from $requirements" >&2
rm -rf "$env_dir"
"$python" -m venv "$env_dir" >&2
"$env_dir/bin/python" -m pip install --quiet pip==26.3 >&2
"$env_dir/bin/python" -m pip install --quiet --progress-bar off -r "$requirements" >&2
"$env_dir/bin/python" -m pip install --quiet --progress-bar off --no-deps \
  --target "$env_dir/sdk-$TINKER_OLDER" "tinker==$TINKER_OLDER" >&2
"$env_dir/bin/python" -c "import aiohttp, grpc, google.protobuf, numpy, zstandard, tinker, tokenizers" >&2
echo "$TINKER_OLDER" > "$env_dir/older-sdk"
cp "$requirements" "$env_dir/.complete"
echo "tinker-env: made in $(( $(date +%s) - start )) s" >&2
echo "$env_dir"
