"""Time of one `Predictor.predict` call per batch bucket, on jax's default device or the host CPU: the cost the
DMLP puts on the engine thread at each eviction (and what `--dmlp-device cpu` trades for not queueing behind the
step in flight on a GPU).

    python benchmarks/dmlp_predict_cost.py --checkpoint DIR --device cpu --out benchmarks/results/X.json
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)

from stratum_jax.dmlp.checkpoint import load_checkpoint  # noqa: E402
from stratum_jax.dmlp.model import Predictor  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a DMLP checkpoint directory (train_dmlp --out)")
    ap.add_argument("--device", default="default", choices=["default", "cpu"])
    ap.add_argument("--rows", default="8,64,256,1024,3000", help="comma-separated row counts")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per row count (median)")
    ap.add_argument("--out", default=None, help="JSON path")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--rows: {a.rows!r} is not a comma-separated list of ints") from None
    if a.calls < 1 or any(r < 1 for r in rows):
        raise SystemExit("--calls and every --rows value must be >= 1")
    ckpt = load_checkpoint(a.checkpoint)
    device = jax.devices("cpu")[0] if a.device == "cpu" else None
    pred = Predictor(ckpt.config, ckpt.params, ckpt.normalizer, device=device)
    features = len(ckpt.normalizer.mean)
    results = []
    for n in rows:
        x = np.random.default_rng(n).uniform(0, 5, (n, features)).astype(np.float32)
        pred.predict(x)                                        # compile (and warm) this bucket
        times = []
        for _ in range(a.calls):
            t = time.perf_counter()
            pred.predict(x)
            times.append(time.perf_counter() - t)
        results.append(dict(rows=n, ms_median=statistics.median(times) * 1e3, ms_min=min(times) * 1e3))
        print(f"{n:6d} rows: {results[-1]['ms_median']:8.2f} ms (min {results[-1]['ms_min']:.2f})", flush=True)
    out = dict(provenance("dmlp_predict_cost", device=str(device or jax.devices()[0])), cpu_count=os.cpu_count(),
               hidden=list(ckpt.config.hidden), calls=a.calls, results=results)
    if a.out:
        save_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
