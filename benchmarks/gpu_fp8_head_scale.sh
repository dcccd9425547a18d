# Device calls (repo root) for fp8 deltas with fixed per-head scales (--fp8-scale head, #12).
#   STEP=kernels (~250 s): the GPU tests of the swapped kernel on fp8 pools, then benchmarks/kernels.py --delta on
#     fp8 only: the delta kernel (granule scales) beside config "fold" (the swapped kernel on the fp8 pools, s_k
#     folded into q and s_v onto the output), against the bf16 paged kernel and the read ceiling of the same run
#     (#12's fp8 kernel bar: <= 0.6x of bf16's time at 4K and 16K).
#   STEP=e2e (~450 s): profile_decode.py on llama-1b, batch 64, prompt 512, fp8-delta with --fp8-scale head (the
#     granule rule's profile: profile_decode_llama-1b_b64_fp8-delta_h200.json, session 16), then e2e_decode.py on
#     llama-8b, batch 64, 4K context, bf16 and fp8-delta --fp8-scale head in one process (#12's end-to-end bar:
#     >= 1.25x bf16's decode tok/s).
#   STEP=sweep (~60 s warm, ~210 s with the GPU tests): the fp8-pool GPU tests, then benchmarks/fp8_fold_sweep.py: the
#     swapped kernel alone on fp8 pools over SwappedConfigs (CONFIGS, overrides of the fp8 default) beside the bf16
#     paged and swapped kernels (session 18's tables in BENCHMARKS.md).
#   STEP=bars (~450 s): the GPU tests of the swapped kernel on f16 and fp8 pools (their assertion lines; on a
#     failure benchmarks/fp8_gpu_diag.py says where and whether a rerun differs), e2e_decode.py on llama-8b 4K
#     bf16 vs fp8-delta --fp8-scale head twice (#12's >= 1.25x), then kernels.py --delta on fp8 (#12's <= 0.6x).
#   STEP=devicebar (~250 s): the fp8-pool GPU tests, then kernels.py --delta on fp8 with --timing both (host and device
#     time per call: #12's kernel bar by the method the 1K paged bar was judged by; BENCHMARKS.md session 22 item 6).
#     PROFILE=1 adds --profile-kernels: each kernel's traced device time, and the fold path interleaved with the paged
#     kernel in one executable (the Pallas kernels' ratio under one clock; BENCHMARKS.md session 23).
#   STEP=paired (~230 s a run): kernels.py --delta on fp8 with --timing both --profile-kernels, RUNS times (default
#     "a b"): #12's kernel bar judged three ways (host, device chain slope, the Pallas kernels interleaved), repeated
#     to see the run-to-run spread (session 23: 0.025 in the paired ratio at 4K page 64).
source benchmarks/gpu_env.sh
case "${STEP:-kernels}" in
  kernels)
    timeout ${T0:-120} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py -k "gpu_reduced_pools and float8" 2>&1 | tail -3
    timeout ${T1:-200} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 \
      --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} --out $OUT/delta_kernels_fp8_head_h200.json \
      > $OUT/fp8_head_bench.log 2>&1
    echo "kernels: exit $?"; grep -v "ptxas\|^\s*$" $OUT/fp8_head_bench.log | grep -E "fold|^ +[0-9]+ +[0-9m]|target|read" | tail -30 ;;
  e2e)
    timeout ${T1:-150} python3 benchmarks/profile_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
      --attention kernel --kv-precision fp8-delta --fp8-scale head --calls 5 --trace-dir /tmp/prof_fp8_head \
      --out $OUT/profile_decode_llama-1b_b64_fp8-delta-head_h200.json > $OUT/profile_fp8_head.log 2>&1
    echo "profile fp8 head: exit $?"; sed -n '/per decode step/,/top kernels/p' $OUT/profile_fp8_head.log | head -32
    timeout ${T2:-260} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
      --attention kernel --kv-precision bf16 fp8-delta --fp8-scale head \
      --out $OUT/e2e_decode_llama-8b_b64_4k_fp8_head_h200.json > $OUT/e2e_8b_4k_head.log 2>&1
    echo "e2e 8b 4k: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]" $OUT/e2e_8b_4k_head.log | tail -20 ;;
  sweep)
    timeout ${T0:-120} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py -k "gpu_reduced_pools and float8" 2>&1 | tail -3
    timeout ${T1:-400} python3 benchmarks/fp8_fold_sweep.py --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} \
      --configs "${CONFIGS:-default;shared_smem=True;shared_smem=True,num_splits=4;shared_smem=True,num_stages=3}" --out $OUT/fp8_fold_sweep_h200.json > $OUT/sweep.log 2>&1
    echo "sweep: exit $?"; grep -v ptxas $OUT/sweep.log | grep -A40 "^ *ctx" ;;
  devicebar)
    timeout ${T0:-120} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py -k "gpu_reduced_pools and float8" 2>&1 | tail -3
    timeout ${T1:-400} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick --timing both \
      ${PROFILE:+--profile-kernels} --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} --out $OUT/delta_kernels_fp8_head_${TAG:-run}_device.json \
      > $OUT/fp8_head_device.log 2>&1
    echo "kernels: exit $?"; grep -v "ptxas\|^\s*$" $OUT/fp8_head_device.log | grep -E "fold|paged:|target|read" | tail -20 ;;
  paired)
    for r in ${RUNS:-a b}; do
      timeout ${T1:-280} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick --timing both \
        --profile-kernels --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} \
        --out $OUT/delta_kernels_fp8_head_${TAG:-run}_paired_$r.json > $OUT/paired_$r.log 2>&1
      echo "paired $r: exit $?"; grep -v ptxas $OUT/paired_$r.log | grep -E "fold|target"
    done ;;
  bars)
    timeout ${T0:-150} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py -k "gpu_reduced_pools" \
      > $OUT/gpu_tests.log 2>&1 || timeout 200 python3 benchmarks/fp8_gpu_diag.py --out $OUT/fp8_gpu_diag.json
    grep -E "^E |passed|failed" $OUT/gpu_tests.log | head -12
    for r in ${RUNS:-a b}; do
      timeout ${T1:-130} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
        --attention kernel --kv-precision bf16 fp8-delta --fp8-scale head \
        --out $OUT/e2e_decode_llama-8b_b64_4k_fp8_head_${TAG:-run}_$r.json > $OUT/e2e_$r.log 2>&1
      echo "e2e $r: exit $?"; grep -E "^llama|x bf16" $OUT/e2e_$r.log
    done
    timeout ${T2:-160} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 \
      --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} --out $OUT/delta_kernels_fp8_head_${TAG:-run}.json \
      > $OUT/fp8_head_bench.log 2>&1
    echo "kernels: exit $?"; grep -v "ptxas\|^\s*$" $OUT/fp8_head_bench.log | grep -E "fold|^ +[0-9]+ +[0-9m]|target|read" | tail -16 ;;
esac
