# Device calls (from the repo root) for session 32's norm fold (#18), each under the 10-minute call limit:
#   STEP=fold   the fold kernels' GPU tests (the cluster fences: 20 calls each), then benchmarks/norm_fold.py on
#               llama-1b and 8b (8-kernel layer vs 6-kernel folded layer, 8 layers, alternating rounds)   ~4-6 min
#   STEP=ab     the e2e step with --fold-norms against without, alternating on one loan, 1b and 8b
#               (gpu_ab_session.sh with BASE=self), PROFILE=1 adds a profile of each side                 ~6-9 min
# JSON under $OUT; BENCHMARKS.md #18 says what was measured.
source benchmarks/gpu_env.sh
case "${STEP:-fold}" in
  fold)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
    timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -p no:randomly -m gpu tests/test_norm_fold.py 2>&1 | tail -6
    echo "tests rc=$?"
    for m in ${MODELS:-llama-1b llama-8b}; do
      tile=$([ $m = llama-1b ] && echo 32 || echo 64)     # split 2 on these tiles: 128 CTAs in clusters of 2
      timeout ${MODEL_TIMEOUT:-240} python3 benchmarks/norm_fold.py --models $m --layers 8 --rounds ${ROUNDS:-2} \
        --cluster-splits ${SPLITS:-auto,2x$tile} --exchanges ${EXCHANGES:-dsmem,l2} ${EXTRA:-} --out $OUT/norm_fold_${m}_${TAG:-s32}.json 2>&1 | grep -v Warn | tail -16
    done ;;
  ab)
    BASE=self THIS_ARGS="--fold-norms" MODELS="${MODELS:-llama-1b llama-8b}" ROUNDS=${ROUNDS:-2} \
      PROFILE=${PROFILE:-0} TAG=${TAG:-s32fold} bash benchmarks/gpu_ab_session.sh ;;
  *) echo "STEP must be fold or ab"; exit 2 ;;
esac
