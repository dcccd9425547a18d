# One device call: the prefill kernels' GPU tests, the kernel sweep (warp-specialised vs the decode
# kernel's pipeline), and the mixed-step timings.
source benchmarks/gpu_env.sh
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python3 -m pytest -q -x -m gpu tests/test_prefill_attention.py ${PREFILL_TESTS:-} 2>&1 | tail -6
timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/prefill_attention.py --models ${PREFILL_MODELS:-llama-1b,llama-8b} \
  --kernel-configs ${PREFILL_CONFIGS:-ws/128:2,ws/64:2,single/128:2} --contexts ${PREFILL_CONTEXTS:-1024,4096,12288,32768} \
  --chunk ${PREFILL_CHUNK:-512} --chunks ${PREFILL_CHUNKS:-3} \
  --out $OUT/prefill_attention_sweep_h200.json 2>&1 | grep -v Warn
[ "${SKIP_MIXED:-0}" = 1 ] || timeout 300 python3 benchmarks/mixed_step.py ${MIXED_ARGS:-} --out $OUT/mixed_step_h200.json 2>&1 | grep -v Warn | tail -60
