# One device call: the prefill kernel's GPU tests, its config sweep, and the mixed-step timings (+ profile).
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 200 python3 -m pytest -q -x -m gpu tests/test_paged_attention.py tests/test_engine_kernel.py 2>&1 | tail -4
timeout 200 python3 benchmarks/prefill_attention.py --models ${PREFILL_MODELS:-llama-1b,llama-8b} \
  --kernel-configs ${PREFILL_CONFIGS:-64:2,128:2} --contexts 1024,4096,12288,32768 \
  --out $OUT/prefill_attention_sweep_h200.json 2>&1 | grep -v Warn
timeout 300 python3 benchmarks/mixed_step.py ${MIXED_ARGS:-} --out $OUT/mixed_step_h200.json 2>&1 | grep -v Warn | tail -60
