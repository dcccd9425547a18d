#!/usr/bin/env bash
# Load test of the OpenAI-compatible HTTP endpoint with an established tool (guidellm), one device call:
#   carry .whl (guidellm 0.8.1 and the wheels it needs beyond the H200 image: README, HTTP endpoint)
#   MODEL=llama-1b STREAMS=8,64 SECONDS_EACH=20 bash benchmarks/http_load_guidellm.sh
# Starts `stratum_jax.serve --http-port 8000`, waits for /health, runs guidellm's concurrent profile at each
# stream count (synthetic prompts of PROMPT_TOKENS, OUTPUT_TOKENS out), writes $OUT/guidellm_*.json and the
# server log tail, and stops the server with SIGTERM (drain).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HF_HUB_OFFLINE=1
MODEL=${MODEL:-llama-1b}
python3 -m stratum_jax.serve --model "$MODEL" --dtype bfloat16 --max-batch-size 64 --max-context 8192 \
  --kv-pool-tokens 262144 --max-queue 2048 --host 127.0.0.1 --port 0 --http-port 8000 \
  ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 150); do curl -sf 127.0.0.1:8000/health >/dev/null && break; sleep 1; done
curl -sf 127.0.0.1:8000/health >/dev/null || { echo "server not healthy"; tail -30 "$OUT/server.log"; kill $SERVER; exit 1; }
echo "server healthy after ${i}s"
timeout ${GUIDELLM_TIMEOUT:-240} python3 -m guidellm run --backend kind=openai_http,target=http://127.0.0.1:8000 \
  --profile kind=concurrent --override profile.streams ${STREAMS:-8,64} \
  --constraint kind=max_duration,seconds=${SECONDS_EACH:-20} \
  --data kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-256},output_tokens=${OUTPUT_TOKENS:-128} \
  --tokenizer kind=huggingface_auto,model=$PWD/stratum_jax/model/weights/pydoc-2m \
  --disable-console-interactive --output kind=json,path=$OUT/guidellm_${MODEL}.json 2>&1 | tail -45 | cut -c1-220
curl -s 127.0.0.1:8000/metrics | grep -E "^stratum_(jit_compilations_after_serving_total|requests_total)" | head -12
kill -TERM $SERVER; wait $SERVER
tail -5 "$OUT/server.log"
