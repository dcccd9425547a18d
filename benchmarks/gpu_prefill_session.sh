# One device call (from the repo root; carry .whl and .carry/traces): the prefill kernels' GPU tests, the
# kernel sweep (warp-specialised vs the decode kernel's pipeline), the mixed-step timings, and the
# follow-ups issue #10 still needs. Each step has its own timeout; SKIP_<STEP>=1 leaves one out.
#   tests    GPU-marked tests of the prefill kernels                                   ~40 s
#   sweep    benchmarks/prefill_attention.py, ws vs single                              ~60-200 s
#   mixed    benchmarks/mixed_step.py (pipelined), + a profile of the 1K+256 case        ~90 s
#   e2e      e2e_decode.py at the trace's prompt length (12K): prefill tok/s like-for-like with the replay  ~60 s
#   startup  two server starts on one compilation cache: cold and warm                  ~100 s
#   replay   the Mooncake replay, HAB vs FCFS (+ HAB with 2 decode steps per call: TTFT p50), 1x/2x  ~330 s
#            (REPLAY_CONFIGS, REPLAY_RATES, REPLAY_PREFIX to change it; it reuses the startup step's cache)
# All of it takes more than one 10-minute call: e.g. SKIP_SWEEP=1 SKIP_REPLAY=1 first, then only the replay.
source benchmarks/gpu_env.sh
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python3 -m pytest -q -x -m gpu tests/test_prefill_attention.py ${PREFILL_TESTS:-} 2>&1 | tail -6
[ "${SKIP_SWEEP:-0}" = 1 ] || timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/prefill_attention.py --models ${PREFILL_MODELS:-llama-1b,llama-8b} \
  --kernel-configs ${PREFILL_CONFIGS:-ws/128:2,ws/64:2,single/128:2} --contexts ${PREFILL_CONTEXTS:-1024,4096,12288,32768} \
  --chunk ${PREFILL_CHUNK:-512} --chunks ${PREFILL_CHUNKS:-3} \
  --out $OUT/prefill_attention_sweep_h200.json 2>&1 | grep -v Warn
[ "${SKIP_MIXED:-0}" = 1 ] || timeout 300 python3 benchmarks/mixed_step.py ${MIXED_ARGS:---cases 1024:1:256:256,12288:1:256:256 --profile $OUT/mixed_prof} \
  --out $OUT/mixed_step_h200.json 2>&1 | grep -v Warn | tail -40
rm -rf $OUT/mixed_prof
[ "${SKIP_E2E:-0}" = 1 ] || timeout 240 python3 benchmarks/e2e_decode.py --model llama-1b --batch 8 --prompt-len 12288 \
  --new-tokens 32 --attention kernel --out $OUT/e2e_llama-1b_b8_prompt12k_h200.json 2>&1 | tail -6
if [ "${SKIP_STARTUP:-0}" != 1 ]; then
  timeout 300 python3 benchmarks/serving.py --model llama-1b --trace .carry/traces/mooncake_conversation.jsonl \
    --num-requests 2 --rates 1 --configs 'cold=--scheduler hab;warm=--scheduler hab' --server-args '--dtype bfloat16
    --max-batch-size 64 --max-context 32768 --kv-pool-tokens 1048576 --compilation-cache-dir /tmp/xc_startup' \
    --run-timeout 290 --request-timeout 30 --out-prefix startup_llama-1b_h200 --server-log-dir $OUT/logs 2>&1 | grep "started in"
  grep -h "compiled\|lowered\|warm-up" $OUT/logs/*.log | cut -c1-160 > $OUT/startup_log_lines.txt; rm -rf $OUT/logs
fi
if [ "${SKIP_REPLAY:-0}" != 1 ]; then
  timeout ${REPLAY_TIMEOUT:-540} python3 benchmarks/serving.py --model llama-1b --trace .carry/traces/mooncake_conversation.jsonl \
    --num-requests 120 --rates ${REPLAY_RATES:-1,2} \
    --configs "${REPLAY_CONFIGS:-hab=--scheduler hab;fcfs=--scheduler fcfs;hab_ds2=--scheduler hab --decode-steps 2}" \
    --server-args '--dtype bfloat16 --max-batch-size 64 --max-context 32768 --kv-pool-tokens 1048576
    --max-queue 1024 --compilation-cache-dir /tmp/xc_startup' --run-timeout $(( ${REPLAY_TIMEOUT:-540} - 20 )) \
    --request-timeout 120 --out-prefix ${REPLAY_PREFIX:-serving_llama-1b_h200_v9} 2>&1 | grep -v Warn | tail -12
  cp benchmarks/results/${REPLAY_PREFIX:-serving_llama-1b_h200_v9}* "$OUT"/ 2>/dev/null
fi
cp benchmarks/results/startup_llama-1b_h200* "$OUT"/ 2>/dev/null
# The device tool brings back at most 8 files: everything also goes back as one tar.
(cd "$OUT" && tar czf /tmp/prefill_session.tgz . && mv /tmp/prefill_session.tgz .)
