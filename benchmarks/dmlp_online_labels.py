"""What the online learner can see on issue #15's shifted workload: per horizon, the share of positive labels
among the examples an `OutcomeTracker` has handed over by time t (an access is labelled at its block's next
use, or once the longest horizon has passed without one), against the true share among the accesses seen.

    PYTHONPATH=$PWD python benchmarks/dmlp_online_labels.py

Computed from the access stream (the tracker's rule, applied to every access; the online replay tracks a
sample of blocks, chosen by id, which does not change the shares). Writes
benchmarks/results/dmlp_online_labels_shifted_cpu.json.
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
for frac in (0.25, 0.5, 0.75, 1.0):
    now = t0 + frac * (t1 - t0)
    seen = t <= now
    emitted = seen & ((hist.next_ms <= now) | (now - t > H[-1]))
    lab = gap[emitted, None] <= H
    out["by_time"].append({"t_frac": frac, "accesses": int(seen.sum()), "emitted": int(emitted.sum()),
                           "positive_share_emitted": lab.mean(0).round(3).tolist(),
                           "positive_share_all_seen_so_far_true": (gap[seen, None] <= H).mean(0).round(3).tolist()})
import jax  # noqa: E402
out.update(command="python benchmarks/dmlp_online_labels.py", shift=m.SHIFT, time_scale=m.TIME_SCALE,
           device=f"cpu ({os.cpu_count()} cores)", jax=jax.__version__, date=datetime.date.today().isoformat(),
           platform=platform.platform())
path = os.path.join(m.RESULTS, "dmlp_online_labels_shifted_cpu.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out["by_time"][-1]), f"span {out['span_ms']:.0f} ms", f"wrote {path}")
