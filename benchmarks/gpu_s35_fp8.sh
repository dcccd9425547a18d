#!/usr/bin/env bash
# #12, built in session 35 without a GPU: the fp8 fold in one launch, and Nsight Compute on the fp8 kernel.
# Device calls (repo root); each prints a short table and writes under $OUT.
#   STEP=tests (~150 s): the compiled one-launch fold against XLA's ops around the kernel and float64
#     (`test_gpu_out_affine_in_kernel`), and the float8 GPU tests already on main.
#   STEP=sweep (~300 s): fp8_fold_sweep.py --fold (the engine's whole fold call, s_k / s_v / a_v included) at 4K
#     over pages 16 / 64 / mixed, interleaved: the default (split-K 2: XLA's q split and merge, 4 launches), no
#     split-K with shared SMEM (one wave of 4 CTAs an SM), that with q's split and the output map in the kernel
#     (one launch), and q's split in the kernel alone (split-K 2), twice (CONFIGS, SWEEP_PAGES to change). CONTEXTS=4096,16384 adds 16K (where the
#     one-launch config holds 3 CTAs an SM: 1.3 waves, expected slower).
#   STEP=bar (~300 s): kernels.py --delta on fp8 at 4K (CONTEXTS to change), host and device timing with the
#     paired profile, the engine's default fold beside ONE (--fold-configs: shown, not counted for the bar until
#     it is the engine's default).
#   STEP=default (~500 s; session 36): kernels.py --delta on fp8 at 4K and 16K with the engine's default fold (q's
#     split in the kernel since session 36) and, shown beside it, FOLD_CONFIGS (default: the split merge and output
#     map in the kernel, `split_merge_in_kernel`), the compiled merge's GPU test, then e2e_decode.py llama-8b B=64
#     4K, bf16 vs fp8-delta (#12's two bars).
#   STEP=lpt (~450 s; session 38): kernels.py --delta at 4K and 16K with the fp8 default (longest-first splits)
#     and even splits beside it, then fp8_fold_sweep.py at batches 32 and 48 (4K, mixed pages), the two alternating.
#   STEP=chain (~150 s; session 39): the timing methods themselves at 4K (PAGES, default 16): kernels.py --delta fp8 with
#     the default chains (8, 40) and 5 calls a host sample, then chains of 40 and 80 (the profile then traces 40
#     calls) and 20 calls a host sample: whether the per-call time outside the Pallas kernel (host and device figures
#     minus the traced kernels) depends on the chain length and the host sample size.
#   STEP=chaincb (~300 s; session 39): benchmarks/chain_overhead.py (chains of 8/40/80 calls of the bar's two kernels
#     at 4K: wall vs the traced GPU span, the host's lead) as is and with XLA's command buffers off, then the chain
#     step's first kernels.py run with command buffers off.
#   STEP=verdict (~300 s; session 39): #12's two delta kernel bars in one kernels.py --delta run (fp16-delta <= 1.1x,
#     fp8-delta <= 0.6x of the bf16 paged kernel at 4K and 16K, pages 16/64/mixed), judged on device time (the
#     default --timing both for --delta), host and Pallas-kernel figures beside.
#   STEP=ncu (~360 s): ncu on the bar's two kernels at 4K (benchmarks/ncu_fp8_attention.py): summary sections for the
#     bf16 paged kernel and the fp8 kernel at pages 16 / 64 / mixed (real clocks), the ONE and MERGED folds' kernels
#     at page 16 (registers: the merge's epilogue must keep <= 168 a thread for 3 CTAs an SM), then the full set with
#     SASS stall samples for fp8 at pages 16 and mixed. PAGES (default "16 64 mixed"), FOLDS ("one merged") and FULL
#     ("16 mixed") narrow it; an empty FOLDS or FULL skips that part.
set -uo pipefail
source benchmarks/gpu_env.sh
ONE="num_splits=1,shared_smem=True,fp8_q_in_kernel=True,out_affine_in_kernel=True"
MERGED="split_merge_in_kernel=True,out_affine_in_kernel=True"     # session 36: split-K 2 merged in the kernel
case "${STEP:-sweep}" in
  tests)
    timeout ${T0:-200} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py \
      -k "gpu_out_affine or (gpu_reduced_pools and float8)" 2>&1 | tail -4
    timeout 100 python3 -m pytest -q -p no:randomly tests/test_fp8_q_split.py -m gpu 2>&1 | tail -2 ;;
  sweep)
    timeout ${T1:-500} python3 benchmarks/fp8_fold_sweep.py --fold --contexts ${CONTEXTS:-4096} --pages ${SWEEP_PAGES:-16,64,mixed} \
      --rounds 2 --configs "${CONFIGS:-default;num_splits=1,shared_smem=True;$ONE;fp8_q_in_kernel=True;default;$ONE}" \
      --out "$OUT/fp8_fold_sweep_one_launch.json" > "$OUT/sweep.log" 2>&1
    echo "sweep: exit $?"; grep -v ptxas "$OUT/sweep.log" | grep -A40 "^ *ctx" ;;
  bar)
    timeout ${T1:-500} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick \
      --timing both --profile-kernels --contexts ${CONTEXTS:-4096} --pages 16,64,mixed \
      --fold-configs "${FOLD_CONFIGS:-$ONE}" \
      --out "$OUT/delta_kernels_fp8_one_launch.json" > "$OUT/bar.log" 2>&1
    echo "bar: exit $?"; grep -v ptxas "$OUT/bar.log" | grep -E "fold|paged:|target|read|^ +[0-9]+ +[0-9m]" | tail -40 ;;
  default)   # session 36: the fp8 default (q split in the kernel) against #12's two bars, in one call (~450 s)
    timeout ${T1:-200} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick \
      --timing both --profile-kernels --contexts ${CONTEXTS:-4096,16384} --pages 16,64,mixed \
      --fold-configs "${FOLD_CONFIGS:-$MERGED}" \
      --out "$OUT/delta_kernels_fp8_default_${TAG:-s36}.json" > "$OUT/bar.log" 2>&1
    echo "bar: exit $?"; grep -v ptxas "$OUT/bar.log" | grep -E "^target|^ +[0-9]+ +[0-9m]+ \| +[0-9.]+ +[0-9.]+% \||fold .*ms x"
    timeout 120 python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py -k gpu_out_affine 2>&1 | tail -3
    timeout ${T2:-300} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
      --attention kernel --kv-precision bf16 fp8-delta --fp8-scale head \
      --out "$OUT/e2e_decode_llama-8b_b64_4k_fp8_head_${TAG:-s36}.json" > "$OUT/e2e.log" 2>&1
    echo "e2e: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]|ptxas" "$OUT/e2e.log" | tail -12 ;;
  lpt)   # session 38: longest-first splits (the fp8 default since then) against even ones, #12's kernel bar at 4K and
         # 16K (paired Pallas, device and host timing), then host-timed at batches 32 and 48 (other wave counts)
    timeout ${T1:-420} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick \
      --timing both --profile-kernels --contexts ${CONTEXTS:-4096,16384} --pages 16,64,mixed \
      --fold-configs "split_first_percent=None" --out "$OUT/delta_kernels_fp8_lpt_${TAG:-s38}.json" > "$OUT/bar.log" 2>&1
    echo "bar: exit $?"; grep -v ptxas "$OUT/bar.log" | grep -E "^target|^ +[0-9]+ +[0-9m]+ \| +[0-9.]+ +[0-9.]+% \||fold .*ms x"
    for b in ${BATCHES:-32 48}; do
      timeout 120 python3 benchmarks/fp8_fold_sweep.py --fold --batch $b --contexts 4096 --pages mixed --rounds 2 \
        --configs "default;split_first_percent=None;default;split_first_percent=None" \
        --out "$OUT/fp8_fold_sweep_lpt_b${b}_${TAG:-s38}.json" > "$OUT/sweep_b$b.log" 2>&1
      echo "batch $b: exit $?"; grep -A6 "^ *ctx" "$OUT/sweep_b$b.log"
    done ;;
  chain)   # session 39: how each timing method's per-call figure depends on its chain length and host sample size
    for spec in "8,40 5" "40,80 20"; do set -- $spec
      timeout ${T1:-200} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick \
        --timing both --profile-kernels --contexts 4096 --pages ${PAGES:-16} --chain $1 --inner $2 \
        --out "$OUT/delta_kernels_fp8_chain${1/,/_}_inner${2}_${TAG:-s39}.json" > "$OUT/chain_$2.log" 2>&1
      echo "chain $1 inner $2: exit $?"; grep -v ptxas "$OUT/chain_$2.log" | grep -E "^target|fold .*ms x"
    done ;;
  chaincb)   # session 39: is the chain slope's excess over the traced kernels the command buffer's host work?
    for cb in default off; do
      flags=${XLA_FLAGS:-}; [ $cb = off ] && flags="$flags --xla_gpu_enable_command_buffer="
      XLA_FLAGS="$flags" timeout ${T1:-200} python3 benchmarks/chain_overhead.py --page ${PAGES:-16} \
        --out "$OUT/chain_overhead_cb_${cb}_${TAG:-s39}.json" > "$OUT/chain_cb_$cb.log" 2>&1
      echo "command buffers $cb: exit $?"; grep -vE "ptxas|^\s*$" "$OUT/chain_cb_$cb.log" | tail -14
    done
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout ${T2:-200} python3 benchmarks/kernels.py --delta \
      --precisions fp8-delta --anchor-lens 1 --quick --timing both --profile-kernels --contexts 4096 --pages ${PAGES:-16} \
      --out "$OUT/delta_kernels_fp8_cb_off_${TAG:-s39}.json" > "$OUT/kernels_cb_off.log" 2>&1
    echo "kernels.py, command buffers off: exit $?"; grep -v ptxas "$OUT/kernels_cb_off.log" | grep -E "^target" ;;
  verdict)   # session 39: both delta bars in one run, judged on device time
    timeout ${T1:-540} python3 benchmarks/kernels.py --delta --precisions fp16-delta,fp8-delta --anchor-lens 1 --quick \
      --profile-kernels --contexts ${CONTEXTS:-4096,16384} --pages 16,64,mixed \
      --out "$OUT/delta_kernels_verdict_${TAG:-s39}.json" > "$OUT/verdict.log" 2>&1
    echo "verdict: exit $?"; grep -v ptxas "$OUT/verdict.log" | grep -E "^target|^ +[0-9]+ +[0-9m]+ \| +[0-9.]+ +[0-9.]+% \|" ;;
  ncu)
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
    SECTIONS="$SECTIONS --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    for k in paged fp8; do for p in ${PAGES:-16 64 mixed}; do
      echo "=== $k page $p ==="
      timeout 150 $NCU --clock-control none -k regex:mosaic --launch-skip 1 --launch-count 1 $SECTIONS \
        python3 benchmarks/ncu_fp8_attention.py --kernel $k --page $p > "$OUT/ncu_${k}_${p}.txt" 2>&1
      grep -E "^    (Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit [A-Z]|Issue Slots Busy|No Eligible|Warp Cycles Per Issued Instruction|Waves Per SM|SM Frequency)|max \|" "$OUT/ncu_${k}_${p}.txt"
    done; done
    for name in ${FOLDS-one merged}; do     # the fold configs' kernels: their registers and CTAs an SM
      cfg=$ONE; [ $name = merged ] && cfg=$MERGED
      echo "=== fp8 fold $name page 16 ==="
      timeout 150 $NCU --clock-control none -k regex:mosaic --launch-skip 1 --launch-count 1 $SECTIONS \
        python3 benchmarks/ncu_fp8_attention.py --kernel fp8 --fold "$cfg" --page 16 > "$OUT/ncu_fp8_${name}_16.txt" 2>&1
      grep -E "^    (Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit [A-Z]|Waves Per SM)|max \|" "$OUT/ncu_fp8_${name}_16.txt"
    done
    for p in ${FULL-16 mixed}; do
      echo "=== full fp8 page $p ==="
      timeout 200 $NCU --clock-control none --set full --import-source no -k regex:mosaic --launch-skip 1 \
        --launch-count 1 -f -o /tmp/fp8_$p python3 benchmarks/ncu_fp8_attention.py --kernel fp8 --page $p \
        > "$OUT/ncu_full_fp8_${p}.log" 2>&1
      tail -1 "$OUT/ncu_full_fp8_${p}.log"
      $NCU -i /tmp/fp8_$p.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass_fp8_${p}.csv" 2>&1
      $NCU -i /tmp/fp8_$p.ncu-rep --page details --csv > "$OUT/ncu_details_fp8_${p}.csv" 2>&1
      gzip -f "$OUT/ncu_sass_fp8_${p}.csv"
    done ;;
esac
