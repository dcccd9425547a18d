# Session 46, one device call (repo root; carry .whl and .carry/traces): on an H200, #12's e2e and kernel bars
# (gpu_s40_granule.sh); on an H100, the #13 pool-pressure stacks replay (262K-token pools, w0 / w1 at 4x) after and
# then before the admission fix (session 45; reverted with benchmarks/results/admission_unfix_s46.patch, applied to
# the tree in place); not yet timed on a GPU. VERSIONS="after" runs the fixed tree only; DEADLINE (s, default 570)
# bounds the call. The replay is gpu_stacks_session.sh's STEP=split with two configs. PRIME=0 skips its first,
# untimed server starts. MODEL, SA (server args), EXTRA (replay args) override for a CPU check of the script.
G=$(nvidia-smi 2>/dev/null --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $G"
if echo "$G" | grep -q H200; then
  STEP=e2e TAG=s46_h200 T1=140 bash benchmarks/gpu_s40_granule.sh
  STEP=bars TAG=s46_h200 CONTEXTS=4096,16384,1024 PAGES=mixed,16 T1=$(( ${DEADLINE:-570} - 10 - SECONDS )) \
    bash benchmarks/gpu_s40_granule.sh
  exit 0
fi
SA=${SA:-'--dtype bfloat16 --max-batch-size 64 --max-context 32768 --kv-pool-tokens 262144 --max-queue 1024
  --compilation-cache-dir /tmp/xc'}
S='--stacks stratum,baseline'
export PRIME=${PRIME:-1} PRIME_TIMEOUT=150
set -- ${VERSIONS:-after before}
for v in "$@"; do
  [ $v = before ] && { patch -s -p1 < benchmarks/results/admission_unfix_s46.patch || exit 4; }
  # the time left (less the prime, when there is one) shared by the versions left
  LEFT=$#; shift; TL=$(( (${DEADLINE:-570} - SECONDS - PRIME * PRIME_TIMEOUT) / LEFT ))
  STEP=split SPLIT_CONFIGS="w0=$S --stratum-weight 0;w1=$S --stratum-weight 1" SERVER_ARGS="$SA" RATES=4 \
    PREFIX=serving_stacks_pool256k_admission_${v}_s46_h100 TIMEOUT=$TL EXTRA_ARGS="${EXTRA:-}" \
    bash benchmarks/gpu_stacks_session.sh
  echo "$v: done at ${SECONDS}s"
  PRIME=0                       # the compilation cache is warm now
done
