# One device call (from the repo root; carry .whl): where the decode step's time goes (issue #18).
#   profile   benchmarks/profile_decode.py for each of PROFILE_MODELS (batch 64, prompt 512 + 256)   ~80-150 s each
#   hf        benchmarks/hf_decode.py, HF transformers on the same shapes and batch, for each of HF_MODELS
#             (default "llama-1b llama-8b"): static-compiled and dynamic for llama-1b, static-compiled for
#             the others (HF_MODES overrides, e.g. static-compiled,generate); ~1.5-2 min for 1b, ~2-3 min
#             for 8b (torch.compile of the decode step is most of it), each under timeout HF_TIMEOUT (270 s)
#   variants  e2e_decode.py for llama-1b under each XLA_VARIANTS entry (NAME=XLA flags|extra flags;...)  ~60 s each
# PROFILE_ARGS / E2E_ARGS / HF_ARGS add flags; SKIP_PROFILE=1 / SKIP_HF=1 / SKIP_VARIANTS=1 leave a step out;
# TAG names the files. The profile and hf steps together are close to one call's 10 minutes: run them in two
# calls (SKIP_HF=1, then SKIP_PROFILE=1) unless HF_MODELS or PROFILE_MODELS is cut down.
source benchmarks/gpu_env.sh
TAG=${TAG:-h200}
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  for m in ${PROFILE_MODELS:-llama-1b llama-8b}; do
    timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/profile_decode.py --model $m --batch 64 --prompt-len 512 \
      --new-tokens 256 --attention kernel --calls 5 ${PROFILE_ARGS:-} --trace-dir /tmp/prof_$m \
      --out $OUT/profile_decode_${m}_b64_${TAG}.json 2>&1 | grep -v Warn | tail -48
  done
fi
if [ "${SKIP_HF:-0}" != 1 ]; then
  for m in ${HF_MODELS:-llama-1b llama-8b}; do
    modes=static-compiled; [ "$m" = llama-1b ] && modes=static-compiled,dynamic
    log=$OUT/hf_decode_${m}_b64_${TAG}.log      # comes back beside the JSON
    timeout -k 15 ${HF_TIMEOUT:-270} python3 benchmarks/hf_decode.py --model $m --batch 64 --prompt-len 512 \
      --new-tokens 256 --modes ${HF_MODES:-$modes} ${HF_ARGS:-} --out $OUT/hf_decode_${m}_b64_${TAG}.json > $log 2>&1
    rc=$?
    # The result rows (model batch mode tok/s step-ms prefill-s warm-up-s) and any failed mode; else the end of the log.
    grep -E "^$m +[0-9]|FAILED" $log | sed "s/^/hf: /" | grep . || { echo "hf $m: exit $rc"; tail -2 $log; }
    [ $rc = 124 ] && echo "hf $m: timed out after ${HF_TIMEOUT:-270} s"
    # A compiled step that fell back (no CUDA graph, or recompiling every step) says so here.
    grep -m2 -iE "skipping cudagraphs|recompile_limit|cache_size_limit" $log | cut -c1-200 | sed "s/^/hf $m: /"
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
