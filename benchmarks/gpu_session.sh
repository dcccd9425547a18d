#!/usr/bin/env bash
# One device call on the H200 machine, from the repo root: GPU-marked tests, the end-to-end decode
# benchmark, and a short serving replay (HAB and FCFS) that also times start-up cold and with a warm
# compilation cache. Carry .whl (grpcio-health-checking / -reflection wheels). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m gpu tests/test_engine_kernel.py tests/test_paged_attention.py \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
if [ "${SKIP_E2E:-0}" != 1 ]; then
  timeout ${E2E_TIMEOUT:-240} python3 benchmarks/e2e_decode.py --model llama-1b --batch 64 --prompt-len 512 \
    --new-tokens 256 --attention kernel --out "$OUT/e2e_decode_llama-1b.json" 2>&1 | tail -6
fi
if [ -n "${SERVING_ARGS:-}" ]; then
  eval timeout ${SERVING_TIMEOUT:-300} python3 benchmarks/serving.py $SERVING_ARGS --server-log-dir "$OUT/logs" 2>&1 | tail -30
  cp benchmarks/results/${SERVING_PREFIX:-serving}*.json benchmarks/results/${SERVING_PREFIX:-serving}*.png "$OUT/" 2>/dev/null
  tail -40 "$OUT"/logs/*.log > "$OUT/server_logs_tail.txt" 2>/dev/null; rm -rf "$OUT/logs"
fi
ls -la "$OUT"
