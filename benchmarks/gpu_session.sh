#!/usr/bin/env bash
# One device call: GPU-marked tests, then the end-to-end decode benchmark. Run from the repo root on the
# H200 machine (its python3 has jax + the CUDA plugin); results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 150 python3 -m pytest -q -m gpu tests/test_engine_kernel.py tests/test_paged_attention.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
timeout ${E2E_TIMEOUT:-400} python3 benchmarks/e2e_decode.py --model llama-1b --batch 64 --prompt-len 512 \
  --new-tokens 256 --attention reference kernel --out "$OUT/e2e_decode_llama-1b.json" 2>&1 | tail -6
