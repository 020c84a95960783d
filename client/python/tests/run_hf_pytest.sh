#!/usr/bin/env bash
# CTest's launcher of the tests against transformers and PEFT: pytest under
# the pinned environment scripts/python-env.sh makes (once per machine, then
# reused; concurrent launchers wait for the first to finish making it).
# Where it cannot be made, the tests skip saying why (exit 77), except under
# CI=true, where that is a failure.
set -uo pipefail
if ! env_dir="$("$AMPD_SOURCE_DIR/scripts/python-env.sh")"; then
  if [[ "${CI:-}" == "true" ]]; then
    echo "FAIL: scripts/python-env.sh could not make the transformers/PEFT environment" >&2
    exit 1
  fi
  echo "SKIP: scripts/python-env.sh could not make the transformers/PEFT environment" \
       "(PyPI unreachable?); these tests need it" >&2
  exit 77
fi
exec "$env_dir/bin/python" -m pytest "$@"
