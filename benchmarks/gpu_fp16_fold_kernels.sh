# One device call (repo root): #12's kernel bars with the fp16-delta fold (kernels.py --delta: the fold's run is
# config "fold" beside the delta kernel's configs; fp8 on the delta kernel), then the fold's mixed step again.  ~300 s
source benchmarks/gpu_env.sh
timeout ${T1:-200} python3 benchmarks/kernels.py --delta --anchor-lens 1 --contexts ${CONTEXTS:-4096,16384} \
  --pages ${PAGES:-16,64,mixed} --out $OUT/delta_kernels_fold_h200.json > $OUT/fold_bench.log 2>&1
echo "kernels: exit $?"; grep -v "ptxas\|^\s*$" $OUT/fold_bench.log | grep -E "fold|^ +[0-9]+ +[0-9m]|target|read" | tail -${TAIL:-30}
timeout ${T2:-90} python3 benchmarks/mixed_step.py --model llama-1b --max-context 16384 --kv-precision fp16-delta \
  --cases 1024:1:4096:12288 --reps 5 --out $OUT/mixed_step_fp16-delta_fold2_h200.json > $OUT/mixed.log 2>&1
echo "== mixed fp16-delta: exit $?"; grep -E "^decode|^case" $OUT/mixed.log
