# One device call (repo root; carry .whl as gpu_env.sh needs): split-K in the warp-specialised prefill kernel
# (`TuningConfig.num_splits`, pallas_kernels/prefill_attention.py), unmeasured until this runs. First its GPU
# tests (bf16 S=2/3 at 64- and 128-token tiles, D=64/128; fp8/fp16 deltas at S=2), then llama-8b's host-tier
# tail shape: one 256-token chunk (8 blocks x 8 kv heads = 64 CTAs) over 8K and 32K contexts, unsplit against
# S=2, "auto" (ws_prefill_splits: 2 here) and 64-token tiles at S=3; every config is checked against the tiled
# path (max |diff|) before it is timed.
source benchmarks/gpu_env.sh
timeout ${T1:-240} python3 -m pytest -q -p no:randomly -m gpu tests/test_ws_prefill_splits.py \
  > $OUT/ws_splits_gpu_tests.log 2>&1; echo "ws split gpu tests: exit $?"
grep -E "passed|failed|Error|error" $OUT/ws_splits_gpu_tests.log | tail -6
timeout ${T2:-240} python3 benchmarks/prefill_attention.py --models llama-8b --contexts 8192,32768 --chunk 256 \
  --chunks 1 --kernel-configs ws/128:2,ws/128:2:2,ws/128:2:auto,ws/64:2:3 --out $OUT/ws_splits_h200.json \
  > $OUT/ws_splits_bench.log 2>&1; echo "bench: exit $?"
tail -4 $OUT/ws_splits_bench.log
