# One device call (repo root; carry .whl, .carry/traces, .carry/dmlp), session 14: the warp-specialised delta
# prefill kernel's GPU tests (default configs) and its speed against the bf16 WS kernel; then the DMLP replay
# with attention statistics on decode tokens only (prefill back on the WS kernel), score-ahead, predictions on
# the CPU. Budget-trimmed: every step has its own timeout.
source benchmarks/gpu_env.sh
timeout ${T1:-170} python3 -m pytest -q -p no:randomly -m gpu tests/test_ws_delta_prefill_attention.py \
  -k "None or matches_single" > $OUT/ws_delta_gpu_tests.log 2>&1; echo "ws delta gpu tests: exit $?"
grep -E "passed|failed|Error|error" $OUT/ws_delta_gpu_tests.log | tail -6
timeout ${T2:-100} python3 benchmarks/kernels.py --delta-prefill --anchor-lens 1 --contexts 16384 --pages 16,128,mixed \
  --out $OUT/delta_prefill_ws_kernels_h200.json > $OUT/ws_delta_bench.log 2>&1; echo "bench: exit $?"
grep -v "^\s*$" $OUT/ws_delta_bench.log | tail -14
STEP=split RATES=4 TIMEOUT=${T3:-130} PRIME_TIMEOUT=${T4:-160} PREFIX=serving_dmlp_decode_stats_llama-1b_h200 \
  SPLIT_CONFIGS="dmlp_ahead_cpu=--cache-policy dmlp --dmlp-checkpoint .carry/dmlp/ckpt/checkpoint --dmlp-device cpu" \
  bash benchmarks/gpu_stacks_session.sh 2>&1 | tail -8
