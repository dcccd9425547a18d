# One device call (repo root; carry .whl) for the swapped-operand decode kernel (issues #18, #12 section 2):
# its GPU tests against the reference, then kernels.py --timing device beside paged_attention at head_dim 64
# (llama-1b) and 128 (llama-8b), read ceiling measured in the same run. ptxas register counts go to the logs.
# CONTEXTS, PAGES, D64_CONFIGS, D128_CONFIGS override the defaults.                            ~300 s
source benchmarks/gpu_env.sh
export MOSAIC_GPU_DUMP_PTXAS=1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:randomly -m gpu tests/test_swapped_decode_attention.py \
  > $OUT/swapped_gpu_tests.log 2>&1; echo "gpu tests: exit $?"; grep -E "passed|failed|Error" $OUT/swapped_gpu_tests.log | tail -5
for d in 64 128; do
  if [ $d = 64 ]; then CFGS=${D64_CONFIGS:-'default;block_kv=64,num_stages=3'}; else CFGS=${D128_CONFIGS:-'default;num_stages=3'}; fi
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/kernels.py --timing device --head-dim $d --default-only --kernels paged,swapped \
    --swapped-configs "$CFGS" --contexts ${CONTEXTS:-1024,4096,16384} --pages ${PAGES:-8,64,mixed} --no-triton --no-xla \
    --out $OUT/kernels_swapped_d${d}_h200.json > $OUT/swapped_d${d}.log 2>&1; echo "D=$d: exit $?"
  grep -v "ptxas\|^\s*$" $OUT/swapped_d${d}.log | tail -${TAIL:-22}
done
grep -hE "ptxas info|registers" $OUT/*.log | sort | uniq -c | sort -rn | head -12
