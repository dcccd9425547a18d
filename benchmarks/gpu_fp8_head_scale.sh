# One device call (repo root): fp8 deltas with fixed per-head scales (--fp8-scale head, #12) against the
# granule rule, where it should show: the DKVC decode step's KV write and scale reductions.
#  1. profile_decode.py on llama-1b, batch 64, prompt 512, fp8-delta with --fp8-scale head (the granule rule's
#     profile of the same shapes: profile_decode_llama-1b_b64_fp8-delta_h200.json, session 16);
#  2. e2e_decode.py on llama-8b, batch 64, 4K context, bf16 and fp8-delta with --fp8-scale head in one
#     process (#12's end-to-end bar: fp8-delta >= 1.25x bf16's decode tok/s).                       ~450 s
source benchmarks/gpu_env.sh
timeout ${T1:-150} python3 benchmarks/profile_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
  --attention kernel --kv-precision fp8-delta --fp8-scale head --calls 5 --trace-dir /tmp/prof_fp8_head \
  --out $OUT/profile_decode_llama-1b_b64_fp8-delta-head_h200.json > $OUT/profile_fp8_head.log 2>&1
echo "profile fp8 head: exit $?"; sed -n '/per decode step/,/top kernels/p' $OUT/profile_fp8_head.log | head -32
timeout ${T2:-260} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
  --attention kernel --kv-precision bf16 fp8-delta --fp8-scale head \
  --out $OUT/e2e_decode_llama-8b_b64_4k_fp8_head_h200.json > $OUT/e2e_8b_4k_head.log 2>&1
echo "e2e 8b 4k: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]" $OUT/e2e_8b_4k_head.log | tail -20
