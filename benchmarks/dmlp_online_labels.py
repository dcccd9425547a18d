"""What the online learner can see on issue #15's shifted workload: per horizon, the share of positive labels
among the labels handed over by time t, against the true share among the accesses seen.

    PYTHONPATH=$PWD python benchmarks/dmlp_online_labels.py [--before | --hold-reuse]

Default (after the fix): the stream's accesses are fed to the real `OutcomeTracker`, which hands each
horizon's label over once it is decided (the block's next use within it, or the horizon passing), with a
`known` mask; shares are over the decided (access, horizon) pairs. Writes
benchmarks/results/dmlp_online_labels_shifted_decided_cpu.json.
--hold-reuse: the tracker holds a reuse's labels to each horizon's deadline (`OutcomeTracker(hold_reuse=True)`),
into dmlp_online_labels_shifted_held_cpu.json.
--before: session 7's rule, computed from the stream (an access handed over whole at its next use, or once
the longest horizon passed), into dmlp_online_labels_shifted_cpu.json. Every access is tracked (the online
replay tracks a sample of blocks, chosen by id, which does not change the shares).
"""
import datetime
import json
import os
import platform
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmlp_mooncake as m  # noqa: E402
from stratum_jax.dmlp.outcomes import OutcomeTracker  # noqa: E402
from training.history import build_history  # noqa: E402
from training.shift import ShiftSpec, derive, read_records  # noqa: E402
from training.synthetic import write_jsonl  # noqa: E402
from training.traces import read_timeline  # noqa: E402

H = np.array([10.0, 50.0, 100.0, 200.0, 500.0])
with tempfile.TemporaryDirectory() as tmp:
    split = m.split_by_time(m.TRACE, tmp)
    p = os.path.join(tmp, "shifted.jsonl")
    write_jsonl(p, derive(read_records(split["eval"]), ShiftSpec(**m.SHIFT)))
    s = read_timeline([p], "mooncake", m.TIME_SCALE)
hist = build_history(s)
t = s.t_ms; gap = hist.next_ms - t
t0, t1 = t[0], t[-1]
out = {"span_ms": float(t1 - t0), "horizons_ms": H.tolist(), "true_positive_share": ((gap[:, None] <= H)).mean(0).round(3).tolist(), "by_time": []}
FRACS = (0.25, 0.5, 0.75, 1.0)
BEFORE, HOLD = "--before" in sys.argv[1:], "--hold-reuse" in sys.argv[1:]
if set(sys.argv[1:]) - {"--before", "--hold-reuse"} or (BEFORE and HOLD):
    sys.exit(f"usage: {sys.argv[0]} [--before | --hold-reuse], got {sys.argv[1:]}")
if not BEFORE:
    # The real tracker, fed request by request as the online replay feeds it; each handed-over row is
    # stamped with the time it was handed over. raw carries the access's index, so labels can be checked.
    got = []
    clock = [0.0]
    tracker = OutcomeTracker(H, lambda raw, lab, known: got.append((np.full(len(raw), clock[0]), lab, known)),
                             hold_reuse=HOLD)
    bounds = np.flatnonzero(np.diff(s.request)) + 1
    blocks = s.block.tolist()
    idx = np.arange(len(t), dtype=np.float32)[:, None]
    for a, b in zip(np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [len(t)]]).tolist()):
        clock[0] = float(t[a])
        tracker.accessed(blocks[a:b], idx[a:b], clock[0])
    tracker.flush()
    at = np.concatenate([g[0] for g in got])
    lab_all, known_all = np.concatenate([g[1] for g in got]), np.concatenate([g[2] for g in got])
for frac in FRACS:
    now = t0 + frac * (t1 - t0)
    seen = t <= now
    row = {"t_frac": frac, "accesses": int(seen.sum()),
           "positive_share_all_seen_so_far_true": (gap[seen, None] <= H).mean(0).round(3).tolist()}
    if BEFORE:
        emitted = seen & ((hist.next_ms <= now) | (now - t > H[-1]))
        lab = gap[emitted, None] <= H
        row.update(emitted=int(emitted.sum()), positive_share_emitted=lab.mean(0).round(3).tolist())
    else:
        # Handed over by now: rows flushed by an access at or before now (a batch may wait a few accesses).
        by = at <= now
        decided = known_all[by].sum(0)
        row.update(rows=int(by.sum()), decided_pairs=decided.astype(int).tolist(),
                   decided_share_of_seen=(decided / seen.sum()).round(3).tolist(),
                   positive_share_decided=[round(float(x), 3) if d else None for x, d in
                                           zip((lab_all[by] * known_all[by]).sum(0) / np.maximum(decided, 1), decided)])
    out["by_time"].append(row)
import jax  # noqa: E402
out.update(command="python benchmarks/dmlp_online_labels.py" + (" --before" if BEFORE else " --hold-reuse" if HOLD else ""),
           rule="whole access at next use or longest horizon" if BEFORE else
                "per horizon, at its deadline, reused or not (OutcomeTracker, hold_reuse)" if HOLD else
                "per horizon, when decided (OutcomeTracker)",
           shift=m.SHIFT, time_scale=m.TIME_SCALE,
           device=f"cpu ({os.cpu_count()} cores)", jax=jax.__version__, date=datetime.date.today().isoformat(),
           platform=platform.platform())
path = os.path.join(m.RESULTS, "dmlp_online_labels_shifted_cpu.json" if BEFORE else
                    "dmlp_online_labels_shifted_held_cpu.json" if HOLD else "dmlp_online_labels_shifted_decided_cpu.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out["by_time"][-1]), f"span {out['span_ms']:.0f} ms", f"wrote {path}")
