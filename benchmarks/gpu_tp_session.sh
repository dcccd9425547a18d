#!/usr/bin/env bash
# Issue 16, the 8B batch-1 target: ONE call on the nvidia-h200-x2 kind, from the repo root, ~5 min of
# device time (BUDGET seconds of runs; each run ~30-40 s for llama-8b, under its own timeout):
#   b1  tp=1, and tp=2 with the replicated embedding/LM head under each --collective-variant of
#       benchmarks/e2e_decode.py (default, one-shot, cmdbuf-collectives, sync-all-reduce, nccl-ll); the
#       default one also profiled and split per decode step (benchmarks/tp_profile_split.py)
#   b64 tp=2 replicated vs vocab-parallel (the figure --tp-embedding auto's rule needs)
# Runs in priority order and skips what would overrun BUDGET. Prints a table; JSON under $OUT:
# e2e_<run>.json per run, split_b1_tp2_replicated.json, tp_session_summary.json (all rows), log_<run>.txt.
# CPU dry run (tiny shapes, two host devices; checks every command line, not figures):
#   OUT=/tmp/tpdry MODEL=tiny PROMPT=16 NEW=48 BIG=4 COPY_GB=0.01 ATTN=reference \
#     XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu bash benchmarks/gpu_tp_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
MODEL=${MODEL:-llama-8b}; PROMPT=${PROMPT:-512}; NEW=${NEW:-128}; BIG=${BIG:-64}; ATTN=${ATTN:-kernel}
COPY_GB=${COPY_GB:-4}; STEP_TIMEOUT=${STEP_TIMEOUT:-90}; BUDGET=${BUDGET:-320}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

run() {  # run NAME ARGS...: one e2e_decode.py run into $OUT/e2e_NAME.json, unless it would overrun BUDGET
  local name=$1; shift
  if (( SECONDS + 35 > BUDGET )); then echo "skip $name: budget"; return; fi
  timeout "$STEP_TIMEOUT" $PY benchmarks/e2e_decode.py --model "$MODEL" --prompt-len "$PROMPT" \
    --new-tokens "$NEW" --attention "$ATTN" --decode-steps 8 --copy-gb "$COPY_GB" --out "$OUT/e2e_$name.json" \
    "$@" >"$OUT/log_$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc at ${SECONDS}s"
  [ "$rc" = 0 ] || tail -4 "$OUT/log_$name.txt"
}
TP2=(--tensor-parallel 2)
run b1_tp1 --batch 1
run b1_tp2_replicated --batch 1 "${TP2[@]}" --tp-embedding replicated --profile-dir "$OUT/prof_b1" --profile-calls 5
if [ -f "$OUT/prof_b1/decode_window.json" ]; then
  timeout 60 $PY benchmarks/tp_profile_split.py "$OUT/prof_b1" --out "$OUT/split_b1_tp2_replicated.json"
fi
rm -rf "$OUT/prof_b1"
run b1_tp2_replicated_one-shot --batch 1 "${TP2[@]}" --tp-embedding replicated --collective-variant one-shot
run b1_tp2_replicated_cmdbuf-collectives --batch 1 "${TP2[@]}" --tp-embedding replicated \
  --collective-variant cmdbuf-collectives
run b${BIG}_tp2_replicated --batch "$BIG" "${TP2[@]}" --tp-embedding replicated
run b${BIG}_tp2_vocab-parallel --batch "$BIG" "${TP2[@]}" --tp-embedding vocab-parallel
run b1_tp2_replicated_sync-all-reduce --batch 1 "${TP2[@]}" --tp-embedding replicated \
  --collective-variant sync-all-reduce
run b1_tp2_replicated_nccl-ll --batch 1 "${TP2[@]}" --tp-embedding replicated --collective-variant nccl-ll

timeout 60 $PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for f in sorted(out.glob("e2e_*.json")):
    r = json.loads(f.read_text())[0]
    rows.append({"run": f.stem[4:], **{k: r[k] for k in ("model", "batch", "tensor_parallel", "tp_embedding",
                 "collective_variant", "decode_step_ms_median", "decode_tokens_per_s", "fraction_of_roofline",
                 "device", "jax", "date")}})
base = {r["batch"]: r["decode_step_ms_median"] for r in rows if r["tensor_parallel"] == 1}
print(f"{'run':40} {'step ms':>8} {'tok/s':>8} {'of roof':>7} {'vs tp1':>6}")
for r in rows:
    ratio = r["decode_step_ms_median"] / base[r["batch"]] if r["batch"] in base else float("nan")
    r["vs_tp1_same_batch"] = ratio
    print(f"{r['run']:40} {r['decode_step_ms_median']:8.2f} {r['decode_tokens_per_s']:8.0f} "
          f"{r['fraction_of_roofline'] or 0:7.1%} {ratio:6.2f}")
split = out / "split_b1_tp2_replicated.json"
summary = {"runs": rows, "split_b1_tp2_replicated": json.loads(split.read_text()) if split.exists() else None}
(out / "tp_session_summary.json").write_text(json.dumps(summary, indent=2))
PY
ls -la "$OUT"
