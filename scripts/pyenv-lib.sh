# Sourced by scripts/python-env.sh and scripts/tinker-env.sh: make_pyenv
# makes (once) a virtual environment from Debian's python3 (or
# $AMPD_PYENV_PYTHON), without system site packages, holding the exact
# versions of a requirements file from PyPI, and prints its directory on
# stdout (nothing else). A finished one carries a .complete copy of the
# requirements; a half-made one is made again. One maker at a time: CTest
# runs the suites that need an environment in parallel.
#
# make_pyenv LABEL ENV_DIR REQUIREMENTS IMPORTS [HOOK]
#   IMPORTS: the modules the users import, checked once made;
#   HOOK: a function run with ENV_DIR after the requirements are installed.
make_pyenv() {
  local label="$1" env_dir="$2" requirements="$3" imports="$4" hook="${5:-}"
  local python="${AMPD_PYENV_PYTHON:-/usr/bin/python3}"
  if [[ -f "$env_dir/.complete" ]] && cmp -s "$requirements" "$env_dir/.complete"; then
    echo "$env_dir"
    return 0
  fi
  mkdir -p "$(dirname "$env_dir")"
  exec 9>"$env_dir.lock"
  flock 9
  if [[ -f "$env_dir/.complete" ]] && cmp -s "$requirements" "$env_dir/.complete"; then
    echo "$env_dir"
    return 0
  fi
  local start
  start=$(date +%s)
  echo "$label: making $env_dir from $requirements" >&2
  rm -rf "$env_dir"
  "$python" -m venv "$env_dir" >&2
  "$env_dir/bin/python" -m pip install --quiet pip==26.3 >&2
  "$env_dir/bin/python" -m pip install --quiet --progress-bar off -r "$requirements" >&2
  if [[ -n "$hook" ]]; then "$hook" "$env_dir" >&2; fi
  "$env_dir/bin/python" -c "import $imports" >&2
  cp "$requirements" "$env_dir/.complete"
  echo "$label: made in $(( $(date +%s) - start )) s" >&2
  echo "$env_dir"
}
