# Device calls (from the repo root) for session 29's L2 prefetch (#18), each under the 10-minute call limit:
#   STEP=prefetch   the GPU test (the kernels with prefetches compile, run and keep their bits), then
#                   benchmarks/l2_prefetch.py on llama-1b and 8b (a decode layer's 8 kernels, 8 layers,
#                   prefetch budgets and per-GEMM variants alternating, 2 rounds)                             ~4-6 min
#   STEP=ab         the e2e step with --l2-prefetch-mb $MB against without, alternating on one loan, 1b and 8b, then
#                   a profile of each (gpu_ab_session.sh with BASE=self; MB from the prefetch step's best, default 16)
#                                                                                                             ~6-8 min
#   STEP=gemm_l2    the decode GEMMs with weights from HBM and from L2 (decode_gemm.py --weights-in-l2): how much any
#                   prefetch could save a GEMM at most                                                        ~2 min
# JSON under $OUT; BENCHMARKS.md #18 says what was measured. Before a call, on this side (no GPU, ~45 s a model):
#   JAX_PLATFORMS=cpu python benchmarks/gpu_preflight.py --model llama-8b --batch 64 --prompt-len 512 --new-tokens 256 \
#     --attention kernel --l2-prefetch-mb $MB     (every step program lowers for CUDA at the real shapes)
source benchmarks/gpu_env.sh
case "${STEP:-prefetch}" in
  prefetch)
    timeout 120 python3 -m pytest -q -p no:randomly -m gpu tests/test_l2_prefetch.py 2>&1 | tail -3
    for m in ${MODELS:-llama-1b llama-8b}; do     # one model at a time, each bounded, so the first lands whole
      timeout ${MODEL_TIMEOUT:-240} python3 benchmarks/l2_prefetch.py --models $m --layers 8 --rounds 2 \
        --budgets "${BUDGETS:-0,8,16,8:qkv,8:o,8:gate_up,8:down,8:attention}" --out $OUT/l2_prefetch_${m}_s29.json 2>&1 \
        | grep -v Warn | tail -9
    done ;;
  ab)
    BASE=self THIS_ARGS="--l2-prefetch-mb ${MB:-16}" MODELS="${MODELS:-llama-1b llama-8b}" ROUNDS=${ROUNDS:-2} \
      PROFILE=${PROFILE:-1} TAG=s29pf${MB:-16} bash benchmarks/gpu_ab_session.sh ;;
  gemm_l2)
    for where in hbm l2; do
      python3 benchmarks/decode_gemm.py --models llama-1b,llama-8b --parts qkv,o,down,gate_up_act --calls 48 \
        $([ $where = l2 ] && echo --weights-in-l2) --out $OUT/decode_gemm_s29_$where.json 2>&1 | grep -v Warn | tail -9
    done ;;
  *) echo "STEP must be prefetch, ab or gemm_l2"; exit 2 ;;
esac
