#!/usr/bin/env bash
# CTest's launcher of the front's tests: pytest under the environment
# scripts/tinker-env.sh makes (once per machine; concurrent launchers wait
# for the first). $1: "newest" (the SDK of scripts/requirements-tinker.txt)
# or "older" (the older SDK beside it, first on PYTHONPATH). Where the
# environment cannot be made the tests skip (77), except under CI=true.
set -uo pipefail
sdk="$1"
shift
if ! env_dir="$("$AMPD_SOURCE_DIR/scripts/tinker-env.sh")"; then
  if [[ "${CI:-}" == "true" ]]; then
    echo "FAIL: scripts/tinker-env.sh could not make the tinker environment" >&2
    exit 1
  fi
  echo "SKIP: scripts/tinker-env.sh could not make the tinker environment (PyPI unreachable?)" >&2
  exit 77
fi
export AMPD_TINKER_PYTHON="$env_dir/bin/python"
sdk_path=""
export AMPD_TINKER_SDK_VERSION
AMPD_TINKER_SDK_VERSION="$(sed -n 's/^tinker==//p' "$AMPD_SOURCE_DIR/scripts/requirements-tinker.txt")"
if [[ "$sdk" == "older" ]]; then
  AMPD_TINKER_SDK_VERSION="$(cat "$env_dir/older-sdk")"
  sdk_path="$env_dir/sdk-$AMPD_TINKER_SDK_VERSION:"
fi
export PYTHONPATH="$sdk_path$AMPD_TINKER_PYTHONPATH"
exec "$env_dir/bin/python" -m pytest "$@"
