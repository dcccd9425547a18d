# Session 46, one device call (repo root; carry .whl and .carry/traces): on an H200, #12's e2e and kernel bars
# (gpu_s40_granule.sh); on an H100, the #13 pool-pressure stacks replay (262K-token pools, w0 / w1 at 4x) after and
# then before the admission fix (session 45; reverted with benchmarks/results/admission_unfix_s46.patch, applied to
# the tree in place). ~450 s. VERSIONS="after" runs the fixed tree only; DEADLINE (s, default 570) bounds the call.
# PRIME=0 skips the first, untimed server start that fills the compilation cache. MODEL, SA (server args), EXTRA
# (replay args) override for a CPU check of the script.
G=$(nvidia-smi 2>/dev/null --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $G"
if echo "$G" | grep -q H200; then
  STEP=e2e TAG=s46_h200 T1=140 bash benchmarks/gpu_s40_granule.sh
  STEP=bars TAG=s46_h200 CONTEXTS=4096,16384,1024 PAGES=mixed,16 T1=$(( ${DEADLINE:-570} - 10 - SECONDS )) \
    bash benchmarks/gpu_s40_granule.sh
  exit 0
fi
source benchmarks/gpu_env.sh
SA=${SA:-'--dtype bfloat16 --max-batch-size 64 --max-context 32768 --kv-pool-tokens 262144 --max-queue 1024
  --compilation-cache-dir /tmp/xc'}
S='--stacks stratum,baseline'
CONFIGS="w0=$S --stratum-weight 0;w1=$S --stratum-weight 1"
T=.carry/traces/mooncake_conversation.jsonl
if [ "${PRIME:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/serving.py --model ${MODEL:-llama-1b} --trace $T \
    --num-requests 4 --length-scale 0.01 --arrivals burst --rates 1 --configs "w1=$S --stratum-weight 1" \
    --server-args "$SA" --request-timeout 60 --out-prefix prime > /tmp/prime.log 2>&1
  echo "prime: exit $? at ${SECONDS}s"; rm -f benchmarks/results/prime*
fi
set -- ${VERSIONS:-after before}
for v in "$@"; do
  [ $v = before ] && { patch -s -p1 < benchmarks/results/admission_unfix_s46.patch || exit 4; }
  P=serving_stacks_pool256k_admission_${v}_s46_h100
  LEFT=$(( $# )); shift; TL=$(( (${DEADLINE:-570} - SECONDS) / LEFT ))    # the time left, shared by what is left
  timeout $TL python3 benchmarks/serving.py --model ${MODEL:-llama-1b} --trace $T \
    --num-requests 120 --rates 4 ${EXTRA:-} --configs "$CONFIGS" --compare-baseline w0 --server-args "$SA" \
    --run-timeout $(( TL - 15 )) --request-timeout 120 --out-prefix $P --server-log-dir $OUT/logs_$v 2>&1 \
    | grep -v Warn | tail -8
  echo "$v: done at ${SECONDS}s"; cp benchmarks/results/${P}* $OUT/ 2>/dev/null
done
