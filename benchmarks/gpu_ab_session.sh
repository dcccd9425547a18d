# One device call (from the repo root): the e2e decode step of this tree against another revision's, alternating on
# one machine loan, so loan-to-loan movement (1-5% between loans on the H200) cancels out of the comparison.
#
#   Here, before the call (the device gets the working tree, not .git; the base tree travels as untracked files):
#     rm -rf ab_base && mkdir ab_base && git archive REV stratum_jax pallas_kernels benchmarks | tar -x -C ab_base \
#       && rm -rf ab_base/benchmarks/results
#   On the device:
#     MODELS="llama-1b llama-8b" ROUNDS=2 TAG=s27 bash benchmarks/gpu_ab_session.sh
#   Afterwards: rm -rf ab_base
#
# Each round runs every model on the base tree, then on this one (benchmarks/e2e_decode.py --batch 64 --prompt-len
# 512 --new-tokens 256 --attention kernel, plus E2E_ARGS); both use this tree's e2e_decode.py, so the two differ only
# in stratum_jax/ and pallas_kernels/. JSON: $OUT/e2e_ab_<model>_<base|this>_<round>_<TAG>.json; prints one line a run
# (step ms, tok/s, SM clock, power) and, per model, the mean step of each side.
# PROFILE=1 then traces each model once on each side (benchmarks/profile_decode.py, same shapes):
# $OUT/profile_decode_<model>_<TAG>_<base|this>.json, and prints each side's wall, busy and parts (~40-60 s a run);
# PROFILE_ARGS adds flags to it alone (a CPU dry run: MODELS=tiny PROFILE_ARGS="--device /host:CPU").
# A flag against its default, on this tree alone: BASE=self, with BASE_ARGS / THIS_ARGS each side's own flags, e.g.
#   BASE=self THIS_ARGS="--l2-prefetch-mb 16" MODELS="llama-1b llama-8b" TAG=s29pf bash benchmarks/gpu_ab_session.sh
source benchmarks/gpu_env.sh
BASE=${BASE:-ab_base}
TAG=${TAG:-ab}
ROOT=$PWD
if [ "$BASE" = self ]; then
  BASE=.
else
  [ -d "$BASE/stratum_jax" ] || { echo "no base tree at $BASE (see the header of this script)"; exit 2; }
  cp benchmarks/*.py "$BASE/benchmarks/"        # the same benchmark script on both sides
fi
side_args() { if [ "$1" = base ]; then echo "${BASE_ARGS:-}"; else echo "${THIS_ARGS:-}"; fi; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for m in ${MODELS:-llama-1b}; do
    for side in base this; do
      tree=$ROOT; [ $side = base ] && tree=$ROOT/$BASE
      json=$OUT/e2e_ab_${m}_${side}_${round}_${TAG}.json
      (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout ${E2E_TIMEOUT:-150} python3 benchmarks/e2e_decode.py \
        --model "$m" --batch 64 --prompt-len 512 --new-tokens 256 --attention kernel ${E2E_ARGS:-} $(side_args $side) \
        --out "$json" \
        > /tmp/e2e_ab.log 2>&1) || { echo "$m $side round $round: FAILED"; tail -3 /tmp/e2e_ab.log; continue; }
      python3 - "$json" "$m" "$side" "$round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
c = r.get("gpu_clocks") or {}
print(f"{sys.argv[2]:9s} {sys.argv[3]:4s} round {sys.argv[4]}: step {r['decode_step_ms_median']:.3f} ms, "
      f"{r['decode_tokens_per_s']:,.0f} tok/s, SM {c.get('sm_mhz_median')} MHz, {c.get('power_w_median')} W")
PY
    done
  done
done
python3 - "$OUT" "$TAG" <<'PY'
import glob, json, statistics, sys
out, tag = sys.argv[1], sys.argv[2]
steps = {}
for f in glob.glob(f"{out}/e2e_ab_*_{tag}.json"):
    model, side = f.split("/")[-1][len("e2e_ab_"):].split("_")[:2]
    steps.setdefault((model, side), []).append(json.load(open(f))[0]["decode_step_ms_median"])
for model in sorted({m for m, _ in steps}):
    base, this = steps.get((model, "base"), []), steps.get((model, "this"), [])
    if base and this:
        b, t = statistics.fmean(base), statistics.fmean(this)
        print(f"{model}: base {b:.3f} ms ({len(base)} runs), this {t:.3f} ms ({len(this)} runs): {t / b - 1:+.1%}")
PY
if [ "${PROFILE:-0}" = 1 ]; then
  for m in ${MODELS:-llama-1b}; do
    for side in base this; do
      tree=$ROOT; [ $side = base ] && tree=$ROOT/$BASE
      json=$OUT/profile_decode_${m}_${TAG}_${side}.json
      (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout ${PROFILE_TIMEOUT:-200} python3 \
        benchmarks/profile_decode.py --model "$m" --batch 64 --prompt-len 512 --new-tokens 256 --attention kernel \
        ${E2E_ARGS:-} $(side_args $side) ${PROFILE_ARGS:-} --trace-dir /tmp/prof_ab_${m}_$side --out "$json" > /tmp/profile_ab.log 2>&1) \
        || { echo "profile $m $side: FAILED"; tail -3 /tmp/profile_ab.log; continue; }
      echo "== profile $m $side"
      grep -E "wall time|GPU busy|^  [a-zA-Z/ ]+ +[0-9.]+$" /tmp/profile_ab.log | grep -v "^  .*->" | head -20
    done
  done
fi
