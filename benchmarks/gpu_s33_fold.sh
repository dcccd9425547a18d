# Device call (from the repo root) for session 33's norm-fold sweep (#18): o's and down's clusters with a shallower
# ring (two CTAs an SM, so 4-block clusters fit the GPCs in one wave), clusters of 2 on half-width tiles, and no
# split on N/128-column tiles (no cluster), all with the L2 exchange; benchmarks/norm_fold.py, 8 layers, 2 rounds.
# ~3-4 min. JSON under $OUT; BENCHMARKS.md #18 session 33 says what was measured.
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
for m in ${MODELS:-llama-1b llama-8b}; do
  if [ $m = llama-1b ]; then splits=${SPLITS_1B:-auto,auto:4,auto:3,2x32,2x32:4,1x16}
  else splits=${SPLITS_8B:-auto,auto:3,auto:2,2x64,2x64:3,1x32}; fi
  timeout ${MODEL_TIMEOUT:-270} python3 benchmarks/norm_fold.py --models $m --layers 8 --rounds ${ROUNDS:-2} \
    --exchanges l2 --cluster-splits $splits --out $OUT/norm_fold_${m}_${TAG:-s33st}.json 2>&1 | grep -v Warn | tail -9
done
