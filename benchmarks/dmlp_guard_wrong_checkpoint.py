"""Issue #15, the wrong checkpoint at the engine's KV cache: prefix-cache hit rate under
`--cache-policy lru`, the deliberately wrong DMLP checkpoint without the guard, and with it, at several
run lengths (the guard's loss must not grow with the run).

    python benchmarks/dmlp_guard_wrong_checkpoint.py [--requests 3000 6000] [--window 512]

The load and checkpoint are training/wrong_checkpoint.py's (the CI test's). Writes
benchmarks/results/dmlp_guard_wrong_checkpoint_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from stratum_jax.config import RuntimeConfig                                  # noqa: E402
from training.wrong_checkpoint import hit_rate, prompts, wrong_checkpoint     # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[3000, 6000])
    ap.add_argument("--window", type=int, default=512, help="--dmlp-guard-window, in block accesses")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dmlp_guard_wrong_checkpoint_cpu.json"))
    a = ap.parse_args()
    if min(a.requests) < 1 or a.window < 1:
        ap.error("--requests and --window must be >= 1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = wrong_checkpoint(os.path.join(tmp, "wrong"))
        for n in a.requests:
            load = prompts(n)
            lru, _ = hit_rate(RuntimeConfig(), load)
            wrong, _ = hit_rate(RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_guard=False), load)
            guarded, policy = hit_rate(RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt,
                                                     dmlp_guard_window=a.window), load)
            g = policy.guard
            runs.append({"requests": n, "lru": lru, "unguarded": wrong, "guarded": guarded,
                         "guard_trips": g.trips, "guard_returns": g.returns, "ghost_rankings": g.ghost.rankings,
                         "guarded_minus_lru_points": round(100 * (guarded - lru), 3),
                         "unguarded_minus_lru_points": round(100 * (wrong - lru), 3),
                         "within_0.5_points": guarded - lru >= -0.005})
            print(json.dumps(runs[-1]), flush=True)
    out = {"what": "prefix-cache hit rate of training/wrong_checkpoint.py's load (prompts(n), hit_rate: 512-slot "
                   "PagePool, 16-token pages, 4 requests held at once) under --cache-policy lru, the deliberately "
                   f"wrong checkpoint without the guard, and with it (--dmlp-guard-window {a.window})",
           "guard": g.settings(),
           "runs": runs, **provenance("dmlp_guard_wrong_checkpoint"), "platform": platform.platform()}
    save_json(a.out, out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
