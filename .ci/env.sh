# Source this file: it finds a Python >= 3.12, creates (or reuses) the project venv in .venv and
# installs the package with the pinned versions of constraints.txt. Afterwards $PY is the venv python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STRATUM_VENV:-$ROOT/.venv}"

_py_ok() {  # is $1 a python interpreter of version >= 3.12?
  [ -n "$1" ] && command -v "$1" >/dev/null 2>&1 &&
    "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python312() {
  local c
  for c in "${STRATUM_PYTHON:-}" python3.12 python3.13 python3.14 python3; do
    if _py_ok "$c"; then command -v "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in $(pyenv root)/versions/3.1[2-9]*/bin/python; do
      if _py_ok "$c"; then echo "$c"; return 0; fi
    done
  fi
  for c in /usr/bin/python3.12 /usr/local/bin/python3.12 "$HOME"/.local/bin/python3.12; do
    if _py_ok "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! BASE_PY="$(find_python312)"; then
    cat >&2 <<'MSG'
error: stratum-jax needs Python >= 3.12 (jax >= 0.11 does), and none was found.
Looked at: $STRATUM_PYTHON, python3.12/3.13/3.14/python3 on PATH, pyenv versions, /usr/bin/python3.12.
Fix one of these ways, then run the same command again:
  - pyenv install 3.12            (then it is found automatically)
  - apt-get install python3.12 python3.12-venv
  - uv python install 3.12 && export STRATUM_PYTHON="$(uv python find 3.12)"
  - export STRATUM_PYTHON=/path/to/python3.12
MSG
    exit 1
  fi
  echo "[env] creating $VENV with $BASE_PY ($("$BASE_PY" --version))" >&2
  "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Re-install only when the pins or the package metadata changed.
STAMP="$VENV/.stratum-stamp"
WANT="$(cat "$ROOT/constraints.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[env] installing stratum-jax and pinned dependencies into $VENV" >&2
  "$PY" -m pip install -q --disable-pip-version-check -U pip >&2
  # --no-compile: byte-compiling every installed module took about half the install's time; Python
  # compiles the modules a process imports, once, on first import.
  "$PY" -m pip install -q --no-compile --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[dev]" >&2
  echo "$WANT" > "$STAMP"
fi
export PY
