# One device call (repo root): where a DKVC decode step's time goes, and #12's end-to-end bar.
#  1. profile_decode.py on llama-1b, batch 64, prompt 512, fp16-delta then fp8-delta (the bf16 profile of the same
#     shapes is profile_decode_llama-1b_b64_swapped_h200.json);
#  2. e2e_decode.py on llama-8b, batch 64, 4K context (prompt 3968 + 128), bf16 and fp8-delta in one process
#     (#12: fp8-delta >= 1.25x bf16's decode tok/s).                                                       ~500 s
source benchmarks/gpu_env.sh
for p in ${PRECISIONS:-fp16-delta fp8-delta}; do
  timeout ${T1:-150} python3 benchmarks/profile_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
    --attention kernel --kv-precision $p --calls 5 --trace-dir /tmp/prof_$p \
    --out $OUT/profile_decode_llama-1b_b64_${p}_h200.json > $OUT/profile_$p.log 2>&1
  echo "profile $p: exit $?"; sed -n '/per decode step/,/top kernels/p' $OUT/profile_$p.log | head -32
  grep -A12 "top kernels" $OUT/profile_$p.log | head -13
done
timeout ${T2:-260} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
  --attention kernel --kv-precision ${E2E_PRECISIONS:-bf16 fp8-delta} --out $OUT/e2e_decode_llama-8b_b64_4k_fp8_h200.json \
  > $OUT/e2e_8b_4k.log 2>&1
echo "e2e 8b 4k: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]" $OUT/e2e_8b_4k.log | tail -20
