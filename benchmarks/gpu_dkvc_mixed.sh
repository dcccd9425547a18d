# One device call (repo root): a DKVC mixed step against bf16's (llama-1b, 64 rows, block tables for 16K), each
# case traced once, to find where the DKVC replay's prefill and TPOT go (#12/#13).                       ~300 s
source benchmarks/gpu_env.sh
for p in ${PRECISIONS:-bf16 fp16-delta fp8-delta}; do
  timeout ${T1:-170} python3 benchmarks/mixed_step.py --model llama-1b --max-context 16384 --kv-precision $p \
    --cases ${CASES:-1024:1:256:8192,1024:1:4096:12288} --reps 5 --profile /tmp/mixed_$p \
    --out $OUT/mixed_step_${p}_h200.json > $OUT/mixed_$p.log 2>&1
  echo "== $p: exit $?"; grep -vE "^\s*$|ptxas|WARNING|it/s\]" $OUT/mixed_$p.log | tail -${TAIL:-45}
done
