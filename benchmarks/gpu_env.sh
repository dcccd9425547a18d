# Sourced by the one-call GPU session scripts (gpu_session.sh, gpu_dkvc_session.sh), from the repo root:
# $OUT made, carried wheels (.whl: grpcio-health-checking / -reflection) installed beside the tree, and the
# environment every run there uses.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
