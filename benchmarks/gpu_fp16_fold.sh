# One device call (repo root): the fp16-delta fold (fp16 deltas with a mean anchor on the plain kernels' f16 path,
# stratum_jax/attention.py `_unit_scale_fold`): its GPU tests, the mixed step on bf16 / fp16-delta, and e2e decode
# on llama-8b at 4K (bf16 vs fp16-delta).                                                                 ~450 s
source benchmarks/gpu_env.sh
timeout ${T0:-120} python3 -m pytest -q -p no:randomly -m gpu tests/test_swapped_decode_attention.py \
  tests/test_prefill_attention.py -k float16 > $OUT/fold_gpu_tests.log 2>&1; echo "gpu tests: exit $?"
grep -E "passed|failed|Error" $OUT/fold_gpu_tests.log | tail -4
for p in ${PRECISIONS:-bf16 fp16-delta}; do
  timeout ${T1:-110} python3 benchmarks/mixed_step.py --model llama-1b --max-context 16384 --kv-precision $p \
    --cases ${CASES:-1024:1:256:8192,1024:1:4096:12288} --reps 5 --out $OUT/mixed_step_${p}_fold_h200.json \
    > $OUT/mixed_$p.log 2>&1
  echo "== mixed $p: exit $?"; grep -E "^decode|^case" $OUT/mixed_$p.log
done
timeout ${T2:-200} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
  --attention kernel --kv-precision bf16 fp16-delta --out $OUT/e2e_decode_llama-8b_b64_4k_fp16_fold_h200.json \
  > $OUT/e2e_8b_4k.log 2>&1
echo "e2e 8b 4k: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]" $OUT/e2e_8b_4k.log | tail -6
