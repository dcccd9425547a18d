# One device call (from the repo root; carry .whl): the decode projections on XLA's dot vs the Pallas
# weight-streaming GEMM (issue #18; stratum_jax/model/projection.py). ~150 s on an H200.
#   gemm     benchmarks/decode_gemm.py: each projection alone, device time per call (SKIP_GEMM=1 leaves it out)
#   e2e      e2e_decode.py --projections xla / kernel for each of MODELS (batch 64, prompt 512 + 256)
#   profile  profile_decode.py --projections kernel for llama-1b (SKIP_PROFILE=1 leaves it out)
source benchmarks/gpu_env.sh >/dev/null 2>&1
TAG=${TAG:-h200}
if [ "${SKIP_GEMM:-0}" != 1 ]; then
  timeout 300 python3 benchmarks/decode_gemm.py --models llama-1b,llama-8b --rows ${GEMM_ROWS:-64} \
    --configs "${GEMM_CONFIGS:-default;tile_n=64}" --out $OUT/decode_gemm_${TAG}.json 2>&1 | grep -v -i warn | tail -12
fi
for m in ${MODELS:-llama-1b llama-8b}; do
  for p in xla kernel; do
    timeout 200 python3 benchmarks/e2e_decode.py --model $m --batch 64 --prompt-len 512 --new-tokens 256 \
      --attention kernel --projections $p --out $OUT/e2e_${m}_b64_proj_${p}_${TAG}.json 2>&1 | grep -v -i warn \
      | tail -2 | head -1 | sed "s/^/$m $p: /"
  done
done
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  timeout 200 python3 benchmarks/profile_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
    --attention kernel --projections kernel --calls 5 --trace-dir /tmp/prof_1b \
    --out $OUT/profile_decode_llama-1b_b64_proj_kernel_${TAG}.json 2>&1 | grep -v -i warn | tail -40
fi
