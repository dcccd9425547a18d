#!/usr/bin/env bash
# #12: fp8-delta's default cache (a scale per 8-slot granule per kv head, packed: `F8PackedGranulePages`) decoded by
# the swapped kernel (the scales copied with each page piece, on S^T's rows and P) instead of the delta kernel.
# Device calls (repo root); each prints a short table and writes under $OUT.
#   STEP=tests (~120 s): the compiled granule-scale kernel against float64 (D 64 / 128, B=64 every page size and B=4
#     split-K with score statistics), the float8 GPU tests already on main, and the engine's compiled bf16 kernel tests.
#   STEP=bar (~450 s): kernels.py --delta on fp8 at CONTEXTS (default 4K and 16K), pages PAGES (default 16,64,mixed):
#     the engine's default fold (granule scales: "fold", counted for the 0.6x bar), the fixed per-head scales' fold
#     beside it ("fold head", --fp8-scale head) and the delta kernel (--decode-kernel paged's path), device, host and
#     paired Pallas timing.
#   STEP=bars: #12's kernel bars in one run, kernels.py --delta --bars-only (fp16 and fp8 at 4K and 16K, pages
#     PAGES, default mixed,16,64; the bf16 kernels at 1K on every page size): ~450 s on an H100 (session 43).
#   STEP=e2e (~100 s on an H100, session 43): e2e_decode.py llama-8b B=64 4K, bf16 vs fp8-delta with its default
#     granule scales (#12's 1.25x bar).
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
case "${STEP:-tests}" in
  tests)
    timeout ${T0:-300} python3 -m pytest -q -p no:randomly tests/test_swapped_decode_attention.py \
      -k "gpu_float8_granule or (gpu_reduced_pools and float8)" 2>&1 | tail -4
    timeout ${T1:-200} python3 -m pytest -q -p no:randomly tests/test_engine_kernel.py -m gpu 2>&1 | tail -3 ;;
  bar)
    timeout ${T1:-560} python3 benchmarks/kernels.py --delta --precisions fp8-delta --anchor-lens 1 --quick \
      --profile-kernels --contexts ${CONTEXTS:-4096,16384} --pages ${PAGES:-16,64,mixed} \
      --out "$OUT/delta_kernels_fp8_granule_${TAG:-s40}.json" > "$OUT/bar.log" 2>&1
    echo "bar: exit $?"; grep -v ptxas "$OUT/bar.log" | grep -E "^target|paged:|fold.*ms x|{.*ms x" | tail -40 ;;
  bars)      # #12's kernel bars in one kernels.py run (--bars-only): fp16/fp8 at 4K and 16K, paged at 1K, every page
    timeout ${T1:-400} python3 benchmarks/kernels.py --delta --bars-only --precisions fp16-delta,fp8-delta \
      --anchor-lens 1 --profile-kernels --contexts ${CONTEXTS:-4096,16384,1024} --pages ${PAGES:-mixed,16,64} \
      --out "$OUT/delta_kernels_bars_${TAG:-s43}.json" > "$OUT/bars.log" 2>&1
    echo "bars: exit $?"; grep -v ptxas "$OUT/bars.log" | grep -E "^target|read ceiling|^ +[0-9]+ +[0-9a-z]+ \|" \
      | tail -40 ;;
  e2e)
    timeout ${T1:-560} python3 benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3968 --new-tokens 128 \
      --attention kernel --kv-precision bf16 fp8-delta \
      --out "$OUT/e2e_decode_llama-8b_b64_4k_fp8_granule_${TAG:-s40}.json" > "$OUT/e2e.log" 2>&1
    echo "e2e: exit $?"; grep -vE "^\s*$|it/s\]|tok/s\]|ptxas" "$OUT/e2e.log" | tail -12 ;;
esac
