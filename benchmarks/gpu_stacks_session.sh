# One device call (from the repo root; carry .whl and .carry/traces) for issue #13: the Mooncake replay of
# llama-1b against a server that runs both stacks (--stacks stratum,baseline) over one copy of the weights.
#   STEP=split   configs w0 / w05 / w1 (--stratum-weight 0, 0.5, 1: all baseline, half, all Stratum), each a
#                fresh two-stack server, at 1x (the recorded rate) and 4x (FCFS's capacity on this replay,
#                BENCHMARKS.md session 11)                                                        ~380 s
#   STEP=ablate  the Stratum stack alone with one pillar changed at a time: hab_off (--scheduler fcfs),
#                pages_off (--page-size 16), dkvc_on (--kv-precision fp16-delta), at 1x and 4x      ~330 s
# RATES, SPLIT_CONFIGS, ABLATE_CONFIGS, PREFIX, MODEL, TRACE, NUM_REQUESTS, SERVER_ARGS, EXTRA_ARGS override the
# defaults (a CPU check of the script: MODEL=tiny NUM_REQUESTS=4 EXTRA_ARGS='--length-scale 0.01' SERVER_ARGS=' ').
# PRIME=1 (the default) first starts every config's server once on a 4-request, 1%-length replay, untimed and not
# saved, so every timed server loads its step shapes from the compilation cache. Why: on 2026-12-02 a server that
# compiled its shapes at start served the replay slower than the same config started warm (goodput 1.54 vs
# 2.52-2.53 req/s for the baseline; BENCHMARKS.md, #13 session 13), so whichever config ran first on a fresh
# machine was handicapped. PRIME=0 skips it (when the cache is known warm).
source benchmarks/gpu_env.sh
SERVER_ARGS=${SERVER_ARGS:-'--dtype bfloat16 --max-batch-size 64 --max-context 32768 --kv-pool-tokens 1048576 --max-queue 1024
  --compilation-cache-dir /tmp/xc_stacks'}
STACKS='--stacks stratum,baseline'
case "${STEP:-split}" in
  split)
    CONFIGS=${SPLIT_CONFIGS:-"w0=$STACKS --stratum-weight 0;w05=$STACKS --stratum-weight 0.5;w1=$STACKS --stratum-weight 1"}
    PREFIX=${PREFIX:-serving_stacks_llama-1b_h200}; BASE=w0 ;;
  ablate)
    CONFIGS=${ABLATE_CONFIGS:-"hab_off=--scheduler fcfs;pages_off=--page-size 16;dkvc_on=--kv-precision fp16-delta"}
    PREFIX=${PREFIX:-serving_stacks_ablation_llama-1b_h200}; BASE=hab_off ;;
esac
if [ "${PRIME:-1}" = 1 ]; then
  t0=$(date +%s)
  timeout ${PRIME_TIMEOUT:-600} python3 benchmarks/serving.py --model ${MODEL:-llama-1b} \
    --trace ${TRACE:-.carry/traces/mooncake_conversation.jsonl} --num-requests 4 --length-scale 0.01 --arrivals burst --rates 1 \
    --configs "$CONFIGS" --server-args "$SERVER_ARGS" --request-timeout 60 --out-prefix ${PREFIX}_prime \
    > /tmp/${PREFIX}_prime.log 2>&1 || echo "prime: exit $? (see the timed run's start-up times)"
  rm -f benchmarks/results/${PREFIX}_prime*
  echo "prime: every config's server started once in $(( $(date +%s) - t0 )) s"
fi
timeout ${TIMEOUT:-450} python3 benchmarks/serving.py --model ${MODEL:-llama-1b} --trace ${TRACE:-.carry/traces/mooncake_conversation.jsonl} \
  --num-requests ${NUM_REQUESTS:-120} ${EXTRA_ARGS:-} --rates ${RATES:-1,4} --configs "$CONFIGS" --compare-baseline $BASE --server-args "$SERVER_ARGS" \
  --run-timeout $(( ${TIMEOUT:-450} - 20 )) --request-timeout 120 --out-prefix $PREFIX \
  --server-log-dir $OUT/logs 2>&1 | grep -v Warn | tail -24
grep -h "pool:\|stacks\|ERROR\|Traceback\|after SERVING" $OUT/logs/*.log 2>/dev/null | cut -c1-240 | head -40 > $OUT/${PREFIX}_server_lines.txt
rm -rf $OUT/logs
cp benchmarks/results/${PREFIX}* "$OUT"/ 2>/dev/null
ls -la "$OUT"
