# One device call (from the repo root) for what session 28 built but could not run (no machine was lent after it):
#   STEP=fp8        (#12) tests/test_fp8_q_split.py's GPU test, then the fp8 kernel alone with and without
#                   SwappedConfig.fp8_q_kernel, and with it and no split-K (no XLA merge after the kernel: the
#                   default's split 2 was the fastest kernel, session 18, but its merge is one more launch on the
#                   bar's path), twice each, at 4K and 16K (fp8_fold_sweep.py; FP8_CONFIGS= to change) ~6-7 min
#   STEP=attention  (#18) attention_bound.py at e2e's context: pages 32 and 64, every layout (session 30 adds
#                   `engine`: the engine's own page tables for e2e's batch, results/engine_page_tables_*.json),
#                   --own-pools 8 (8 copies of the pools in turn, as 8 layers read theirs: no L2 reuse between
#                   calls) and --between (the kernel interleaved with a GEMM of the o projection's size: 8 MB at
#                   llama-1b's D=64, 32 MB at 8b's)                                                             ~3-4 min
# JSON under $OUT. The fold path itself (the #12 bar) is measured with the flag on in the default, on an A/B tree:
# see BENCHMARKS.md #12 session 28.
source benchmarks/gpu_env.sh
case "${STEP:-fp8}" in
  fp8)
    ONE_ROUND="default;fp8_q_kernel=True;fp8_q_kernel=True,num_splits=1"
    python3 -m pytest -q -p no:randomly -m gpu tests/test_fp8_q_split.py 2>&1 | tail -3
    python3 benchmarks/fp8_fold_sweep.py --contexts 4096,16384 --pages 16,64,mixed \
      --configs "${FP8_CONFIGS:-$ONE_ROUND;$ONE_ROUND}" \
      --out $OUT/fp8_fold_sweep_s28_qsplit.json 2>&1 | grep -v Warn | tail -22 ;;
  attention)
    python3 benchmarks/attention_bound.py --head-dims 64 --contexts 640 --pages 32,64 --between 8 --own-pools 8 \
      --out $OUT/attention_bound_between_d64.json 2>&1 | grep -v Warn | tail -4
    python3 benchmarks/attention_bound.py --head-dims 128 --contexts 640 --pages 32,64 --between 32 --own-pools 8 \
      --out $OUT/attention_bound_between_d128.json 2>&1 | grep -v Warn | tail -4 ;;
  *) echo "STEP must be fp8 or attention"; exit 2 ;;
esac
