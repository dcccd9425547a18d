# One device call (from the repo root; carry .whl): where the decode step's time goes (issue #18).
#   profile   benchmarks/profile_decode.py for each of PROFILE_MODELS (batch 64, prompt 512 + 256)   ~80-150 s each
#   variants  e2e_decode.py for llama-1b under each XLA_VARIANTS entry (NAME=XLA flags|extra flags;...)  ~60 s each
# PROFILE_ARGS / E2E_ARGS add flags; SKIP_PROFILE=1 / SKIP_VARIANTS=1 leave a step out; TAG names the files.
source benchmarks/gpu_env.sh
TAG=${TAG:-h200}
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  for m in ${PROFILE_MODELS:-llama-1b llama-8b}; do
    timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/profile_decode.py --model $m --batch 64 --prompt-len 512 \
      --new-tokens 256 --attention kernel --calls 5 ${PROFILE_ARGS:-} --trace-dir /tmp/prof_$m \
      --out $OUT/profile_decode_${m}_b64_${TAG}.json 2>&1 | grep -v Warn | tail -48
  done
fi
if [ "${SKIP_VARIANTS:-0}" != 1 ]; then
  IFS=';' read -ra VARIANTS <<< "${XLA_VARIANTS:-}"
  for v in "${VARIANTS[@]}"; do
    name=${v%%=*}; spec=${v#*=}; flags=${spec%%|*}; extra=""; [[ "$spec" == *"|"* ]] && extra=${spec#*|}
    XLA_FLAGS="$flags" timeout 200 python3 benchmarks/e2e_decode.py --model llama-1b --batch 64 --prompt-len 512 \
      --new-tokens 256 --attention kernel ${E2E_ARGS:-} $extra --out $OUT/e2e_llama-1b_b64_${name}_${TAG}.json 2>&1 | grep -v Warn | tail -2 | head -1 | sed "s/^/$name: /"
  done
fi
