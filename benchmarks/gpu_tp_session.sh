#!/usr/bin/env bash
# Issue 16, the 8B batch-1 target: ONE call on the nvidia-h200-x2 kind, from the repo root, ~5 min of
# device time (runs start only while under BUDGET=300 s, each ~30-40 s for llama-8b and at most 90 s):
#   b1  tp=1; tp=2 with the replicated embedding/LM head, default and one-shot all-reduce, both profiled
#       and split per decode step (benchmarks/tp_profile_split.py)
#   b64 tp=2 replicated vs vocab-parallel (the figure --tp-embedding auto's rule needs)
#   b1  tp=2 replicated under the other --collective-variant values of benchmarks/e2e_decode.py
#       (cmdbuf-collectives, one-shot+cmdbuf, sync-all-reduce, nccl-ll), in that order
# Runs in priority order and skips what would overrun BUDGET. Prints a table; JSON under $OUT:
# e2e_<run>.json per run, split_<run>.json, tp_session_summary.json (all rows), log_<run>.txt, and all of
# them in tp_session.tgz.
# CPU dry run (tiny shapes, two host devices; checks every command line, not figures):
#   OUT=/tmp/tpdry MODEL=tiny PROMPT=16 NEW=48 BIG=4 COPY_GB=0.01 ATTN=reference SPLIT_DEVICE=/host:CPU \
#     XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu bash benchmarks/gpu_tp_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
MODEL=${MODEL:-llama-8b}; PROMPT=${PROMPT:-512}; NEW=${NEW:-128}; BIG=${BIG:-64}; ATTN=${ATTN:-kernel}
COPY_GB=${COPY_GB:-4}; STEP_TIMEOUT=${STEP_TIMEOUT:-90}; BUDGET=${BUDGET:-300}; SPLIT_DEVICE=${SPLIT_DEVICE:-GPU}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

run() {  # run NAME ARGS...: one e2e_decode.py run into $OUT/e2e_NAME.json, unless it would overrun BUDGET
  local name=$1; shift
  if (( SECONDS + 35 > BUDGET )); then echo "skip $name: budget"; return; fi
  timeout -k 10 "$STEP_TIMEOUT" $PY benchmarks/e2e_decode.py --model "$MODEL" --prompt-len "$PROMPT" \
    --new-tokens "$NEW" --attention "$ATTN" --decode-steps 8 --copy-gb "$COPY_GB" --out "$OUT/e2e_$name.json" \
    "$@" >"$OUT/log_$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc at ${SECONDS}s"
  [ "$rc" = 0 ] || tail -4 "$OUT/log_$name.txt"
}
split() {  # split NAME: the profile of run NAME split per decode step into $OUT/split_NAME.json
  if [ -f "$OUT/prof_$1/decode_window.json" ]; then
    timeout -k 5 60 $PY benchmarks/tp_profile_split.py "$OUT/prof_$1" --out "$OUT/split_$1.json" --device "$SPLIT_DEVICE"
  fi
  rm -rf "$OUT/prof_$1"
}
B1=(--batch 1 --tensor-parallel 2 --tp-embedding replicated)
PROFILE=(--profile-calls 5 --profile-dir)
run b1_tp1 --batch 1
run b1_tp2_replicated "${B1[@]}" "${PROFILE[@]}" "$OUT/prof_b1_tp2_replicated"
split b1_tp2_replicated
run b1_tp2_replicated_one-shot "${B1[@]}" --collective-variant one-shot "${PROFILE[@]}" "$OUT/prof_b1_tp2_replicated_one-shot"
split b1_tp2_replicated_one-shot
run b${BIG}_tp2_replicated --batch "$BIG" --tensor-parallel 2 --tp-embedding replicated
run b${BIG}_tp2_vocab-parallel --batch "$BIG" --tensor-parallel 2 --tp-embedding vocab-parallel
run b1_tp2_replicated_cmdbuf-collectives "${B1[@]}" --collective-variant cmdbuf-collectives
run b1_tp2_replicated_one-shot+cmdbuf "${B1[@]}" --collective-variant one-shot+cmdbuf
run b1_tp2_replicated_sync-all-reduce "${B1[@]}" --collective-variant sync-all-reduce
run b1_tp2_replicated_nccl-ll "${B1[@]}" --collective-variant nccl-ll   # NCCL picks LL for small messages anyway

timeout 60 $PY - "$OUT" "$MODEL" <<'PY'
import json, pathlib, sys
out, model = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = []
for f in sorted(out.glob("e2e_*.json")):
    r = json.loads(f.read_text())[0]
    rows.append({"run": f.stem[4:], **{k: r[k] for k in ("model", "batch", "tensor_parallel", "tp_embedding",
                 "collective_variant", "decode_step_ms_median", "decode_tokens_per_s", "fraction_of_roofline",
                 "device", "jax", "date")}})
# tp=1 at the same batch: from this session, else the earlier two-H200 run in benchmarks/results (marked *).
base = {r["batch"]: (r["decode_step_ms_median"], "") for r in rows if r["tensor_parallel"] == 1}
for batch in {r["batch"] for r in rows} - set(base):
    earlier = pathlib.Path(f"benchmarks/results/e2e_{model}_b{batch}_tp1_h200x2.json")
    if earlier.exists():
        base[batch] = (json.loads(earlier.read_text())[0]["decode_step_ms_median"], "*")
print(f"{'run':40} {'step ms':>8} {'tok/s':>8} {'of roof':>7} {'vs tp1':>7}")
for r in rows:
    ms, mark = base.get(r["batch"], (float("nan"), ""))
    r["vs_tp1_same_batch"], r["tp1_from_earlier_run"] = r["decode_step_ms_median"] / ms, mark == "*"
    print(f"{r['run']:40} {r['decode_step_ms_median']:8.2f} {r['decode_tokens_per_s']:8.0f} "
          f"{r['fraction_of_roofline'] or 0:7.1%} {r['vs_tp1_same_batch']:6.2f}{mark or ' '}")
splits = {f.stem[6:]: json.loads(f.read_text()) for f in sorted(out.glob("split_*.json"))}
for name, s in splits.items():
    first = min(s["per_step"])                  # /device:GPU:0
    gpu = s["per_step"][first]
    print(f"split {name}: compute {gpu['compute_ms_per_step']:.3f} + communication "
          f"{gpu['communication_ms_per_step']:.3f} ms, busy {gpu['busy_ms_per_step']:.3f} of "
          f"{s['wall_ms_per_step_median']:.3f} ms wall per step ({first}, {s['steps']} steps)")
(out / "tp_session_summary.json").write_text(json.dumps({"runs": rows, "splits": splits}, indent=2))
PY
ls -la "$OUT"
# The device tool brings back at most 8 files: everything also goes back as one tar.
(cd "$OUT" && tar czf /tmp/tp_session.tgz . && mv /tmp/tp_session.tgz .)
