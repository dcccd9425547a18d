#!/usr/bin/env bash
# Issue 16, "serving runs the 70B shape at tp = 2": ONE call on the nvidia-h200-x2 kind, from the repo root
# (carry .whl and .carry/traces), ~6-9 min of device time. The Mooncake replay through benchmarks/serving.py
# against `serve --model llama-70b --tensor-parallel 2` (random init, created sharded), prompts scaled down so
# a short window fits one call; the server's compile log lines are kept. Everything under $OUT is packed into
# one tar (the device tool brings back at most 8 files).
# CPU dry run (tiny, two host devices):
#   OUT=/tmp/tpserve MODEL=tiny SCALE=0.01 REQUESTS=4 XLA_FLAGS=--xla_force_host_platform_device_count=2 \
#     MAXCTX=1024 JAX_PLATFORMS=cpu bash benchmarks/gpu_tp_serving_session.sh
source benchmarks/gpu_env.sh
MODEL=${MODEL:-llama-70b}; SCALE=${SCALE:-0.125}; REQUESTS=${REQUESTS:-32}; RATES=${RATES:-1,2}
PREFIX=serving_${MODEL}_tp2_h200x2
timeout -k 10 ${RUN_TIMEOUT:-560} python3 benchmarks/serving.py --model "$MODEL" \
  --trace ${TRACE:-.carry/traces/mooncake_conversation.jsonl} --num-requests "$REQUESTS" --rates "$RATES" \
  --length-scale "$SCALE" --configs 'tp2=--tensor-parallel 2' --server-args "--dtype bfloat16 --max-batch-size 32
  --max-context ${MAXCTX:-8192} --max-num-batched-tokens 1056 --kv-pool-tokens 131072 --max-queue 1024
  --compilation-cache-dir /tmp/xc70" --start-timeout ${START_TIMEOUT:-420} --run-timeout $(( ${RUN_TIMEOUT:-560} - 10 )) \
  --request-timeout 120 --out-prefix "$PREFIX" --server-log-dir "$OUT/logs" 2>&1 | grep -v Warn | tail -20
grep -h "compiled\|warm-up\|SERVING\|loaded\|mesh\|tensor" "$OUT"/logs/*.log | cut -c1-200 > "$OUT/${PREFIX}_log_lines.txt"
cp benchmarks/results/"$PREFIX"* "$OUT"/ 2>/dev/null
rm -rf "$OUT/logs"; (cd "$OUT" && tar czf ../tp_serving.tgz . && mv ../tp_serving.tgz .) ; ls -la "$OUT"
