# Source this file: it creates (or reuses) .venv-hf, a side venv on Python 3.11 with torch + transformers
# for the live HF parity test (tests/test_hf_parity.py), and exports STRATUM_HF_PYTHON. The project venv
# stays torch-free; torch's CPU wheel here exists for Python 3.11 only.
# It is sourced under `set -euo pipefail` and never exits the caller: on any failure it returns 1 and
# the parity test falls back to the committed golden files.

_stratum_hf_env() {
  local root venv base c want_torch="2.13.0" want_tf="5.17.0"
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  venv="${STRATUM_HF_VENV:-$root/.venv-hf}"

  _is_py311() { [ -n "$1" ] && [ -x "$1" ] && "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1; }

  if ! _is_py311 "$venv/bin/python"; then
    base=""
    for c in "${STRATUM_HF_BASE_PYTHON:-}" \
             $(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/3.11*/bin/python3.11 2>/dev/null) \
             "$(command -v python3.11 2>/dev/null || true)" /usr/bin/python3.11 /usr/local/bin/python3.11; do
      if _is_py311 "$c"; then base="$c"; break; fi
    done
    if [ -z "$base" ]; then
      echo "[hf-env] no Python 3.11 found (pyenv, python3.11 on PATH, \$STRATUM_HF_BASE_PYTHON)" >&2
      return 1
    fi
    echo "[hf-env] creating $venv with $base" >&2
    rm -rf "$venv" && "$base" -m venv "$venv" || return 1
  fi

  if ! "$venv/bin/python" -c "
import sys, torch, transformers
sys.exit(torch.__version__.split('+')[0] != '$want_torch' or transformers.__version__ != '$want_tf')" >/dev/null 2>&1; then
    echo "[hf-env] installing torch==$want_torch transformers==$want_tf into $venv" >&2
    # --no-compile: byte-compiling torch and transformers took about half the install's time.
    "$venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "torch==$want_torch" \
      "transformers==$want_tf" >&2 ||
      return 1
  fi
  export STRATUM_HF_PYTHON="$venv/bin/python"
}

if _stratum_hf_env; then
  unset -f _stratum_hf_env _is_py311
else
  unset -f _stratum_hf_env _is_py311
  return 1
fi
