#!/usr/bin/env bash
# One device call on the H200 machine, from the repo root: GPU-marked tests, the end-to-end decode
# benchmark, and a short serving replay (HAB and FCFS) that also times start-up cold and with a warm
# compilation cache. Carry .whl (grpcio-health-checking / -reflection wheels). Results land in $OUT.
set -uo pipefail
source benchmarks/gpu_env.sh
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
# Tensor parallelism (issue 16) on the nvidia-h200-x2 kind, one mode per device call (each fits 10 min):
#   TP_BENCH=8b-b1   llama-8b at batch 1: tp=1, tp=2 (vocab-parallel, profiled and split into compute and
#                    communication), tp=2 with a replicated embedding/LM head
#   TP_BENCH=8b-b64  llama-8b at batch 64: tp=1, tp=2 (profiled and split)
#   TP_BENCH=70b  llama-70b at tp=2, batch 32, prompt 512 + 128, profiled and split
# (with SKIP_TESTS=1 SKIP_E2E=1 to run only these). The embedding is named explicitly: the default is now auto.
# The follow-up (collective variants, batch 64 replicated) is benchmarks/gpu_tp_session.sh.
tp_run() {  # tp_run NAME ARGS...: one e2e_decode run into $OUT/e2e_NAME.json, profile split if profiled
  local name=$1; shift
  timeout ${TP_TIMEOUT:-190} python3 benchmarks/e2e_decode.py --prompt-len 512 --new-tokens 128 --attention kernel \
    --decode-steps 8 --copy-gb 4 --out "$OUT/e2e_$name.json" "$@" 2>&1 | tail -3
  if [ -d "$OUT/prof_$name" ]; then
    python3 benchmarks/tp_profile_split.py "$OUT/prof_$name" --out "$OUT/split_$name.json"
    rm -rf "$OUT/prof_$name"
  fi
}
if [ "${TP_BENCH:-}" = 8b-b1 ]; then
  tp_run llama-8b_b1_tp1 --model llama-8b --batch 1
  tp_run llama-8b_b1_tp2 --model llama-8b --batch 1 --tensor-parallel 2 --tp-embedding vocab-parallel --profile-dir "$OUT/prof_llama-8b_b1_tp2"
  tp_run llama-8b_b1_tp2_replicated --model llama-8b --batch 1 --tensor-parallel 2 --tp-embedding replicated
fi
if [ "${TP_BENCH:-}" = 8b-b64 ]; then
  tp_run llama-8b_b64_tp1 --model llama-8b --batch 64
  tp_run llama-8b_b64_tp2 --model llama-8b --batch 64 --tensor-parallel 2 --tp-embedding vocab-parallel --profile-dir "$OUT/prof_llama-8b_b64_tp2"
fi
if [ "${TP_BENCH:-}" = 70b ]; then
  TP_TIMEOUT=${TP_TIMEOUT:-540} tp_run llama-70b_b32_tp2 --model llama-70b --batch 32 --tensor-parallel 2 \
    --tp-embedding vocab-parallel \
    --profile-dir "$OUT/prof_llama-70b_b32_tp2"
fi
if [ -n "${SERVING_ARGS:-}" ]; then
  eval timeout ${SERVING_TIMEOUT:-300} python3 benchmarks/serving.py $SERVING_ARGS --server-log-dir "$OUT/logs" 2>&1 | tail -30
  cp benchmarks/results/${SERVING_PREFIX:-serving}*.json benchmarks/results/${SERVING_PREFIX:-serving}*.png "$OUT/" 2>/dev/null
  tail -40 "$OUT"/logs/*.log > "$OUT/server_logs_tail.txt" 2>/dev/null; rm -rf "$OUT/logs"
fi
ls -la "$OUT"
