"""Per-access cost of the DMLP guard's ghosts on the CPU: the shadow-LRU guard alone (no ghost DMLP),
with its ghost DMLP mirroring the real cache (DMLP mode), and with the ghost evicting by itself (LRU
mode: a ranking by the policy's own `reuse_before_eviction` per slack-sized batch), at several cache
sizes. The real cache is an LRU of the same size in front of it (what the guard sees in LRU mode).

    PYTHONPATH=$PWD python benchmarks/dmlp_ghost_cost.py [--accesses 200000] [--capacities 1024 8192 32768]

Keys are Zipf-popular (so hits and misses both occur); curves are random increasing [N, 5]. The guard's
cost is the loop's time with the guard minus the same loop without it, per access; the model's own
scoring is not included (the replay precomputes curves; in the engine, the ghost scores the features of
the keys a ranking needs, in one model call per ranking, which benchmarks/dmlp_engine_overhead.py's
dmlp-lru-mode condition measures).
Writes benchmarks/results/dmlp_ghost_cost_cpu.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from run_record import provenance, save_json  # noqa: E402  (beside this script)

H = (10.0, 50.0, 100.0, 200.0, 500.0)


def run(keys, curves, capacity, mode, policy_factory):
    """Seconds to feed `keys` through a real LRU cache of `capacity` (and the guard, unless mode is
    "none"). mode: none, guard-only (no ghost DMLP), mirror (ghost mirrors: DMLP mode), lru (tripped)."""
    guard = None
    if mode != "none":
        guard = policy_factory(ghost=mode != "guard-only")
        if mode == "lru":
            guard.trip()
    order: collections.OrderedDict = collections.OrderedDict()
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        if guard is not None:
            guard.accessed([k], curves[i:i + 1], float(i))
        if k in order:
            order.move_to_end(k)
            continue
        if len(order) >= capacity:
            victim, _ = order.popitem(last=False)
            if guard is not None:
                guard.forget([victim])
        order[k] = None
    return time.perf_counter() - t0, guard


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accesses", type=int, default=200_000)
    ap.add_argument("--capacities", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=3, help="runs per condition; the fastest counts")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dmlp_ghost_cost_cpu.json"))
    a = ap.parse_args()
    if a.accesses < 1 or min(a.capacities) < 1 or a.repeats < 1:
        ap.error("--accesses, --capacities and --repeats must be >= 1")
    from stratum_jax.dmlp.features import FEATURE_NAMES
    from stratum_jax.dmlp.guard import ShadowLruGuard
    from stratum_jax.dmlp.model import DmlpConfig, Predictor, init_params
    from stratum_jax.dmlp.features import Normalizer
    from stratum_jax.dmlp.policy import DmlpPolicy

    f = len(FEATURE_NAMES)
    cfg = DmlpConfig(num_inputs=2 * f, horizons_ms=H, hidden=(8,))
    pred = Predictor(cfg, init_params(cfg, 0), Normalizer(np.zeros(f, np.float32), np.ones(f, np.float32)))

    def policy_factory(ghost: bool):
        """The guard alone, or the guard a DmlpPolicy gives its ghost DMLP (the policy's own ranking)."""
        if not ghost:
            return ShadowLruGuard(window=2048)
        return DmlpPolicy(pred, guard=ShadowLruGuard(window=2048)).guard

    rng = np.random.default_rng(0)
    results = []
    for cap in a.capacities:
        keys = (rng.zipf(1.2, a.accesses) % (20 * cap)).tolist()
        curves = np.sort(rng.random((a.accesses, len(H))), axis=1).astype(np.float32)
        t = {}
        for mode in ("none", "guard-only", "mirror", "lru"):
            best, guard = min((run(keys, curves, cap, mode, policy_factory) for _ in range(a.repeats)),
                              key=lambda r: r[0])
            t[mode] = best
            if mode == "lru":
                rankings = guard.ghost.rankings
                ghost_rate = guard.ghost_hit_rate
        row = {"capacity": cap, "accesses": a.accesses,
               **{f"{m}_us_per_access": round(1e6 * (t[m] - t["none"]) / a.accesses, 3) for m in t if m != "none"},
               "loop_us_per_access": round(1e6 * t["none"] / a.accesses, 3),
               "lru_mode_rankings": rankings, "lru_mode_last_ghost_hit_rate": ghost_rate}
        results.append(row)
        print(json.dumps(row), flush=True)
    out = {"what": "guard cost per block access (us), over a Python LRU cache loop (loop_us_per_access); "
                   "guard-only: shadow LRU, no ghost DMLP; mirror: + ghost DMLP mirroring (DMLP mode); "
                   "lru: + ghost DMLP ranking its own evictions (LRU mode, slack 1/64)",
           "runs": results, **provenance("dmlp_ghost_cost"), "platform": platform.platform()}
    save_json(a.out, out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
