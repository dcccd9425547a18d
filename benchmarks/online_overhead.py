"""Decode step time with the online DMLP fine-tuner off and on (target: at most 2% slower).

    python benchmarks/online_overhead.py

The decode step is a stand-in until the engine's real step is wired in: a jitted pair of
[32, 2560] x [2560, 2560] matmuls (about 12 ms on one core here), plus what the engine does per step for
the DMLP: one `observe()` of 32 (features, labels) pairs. The fine-tuner worker trains the
1.2M-parameter model at its CPU budget ("on") or is paused ("off"); the two alternate in blocks of
`BLOCK` steps, so slow drifts of the machine hit both alike. Two set-ups, each in its own process:

- pinned: the engine process on core 0, the worker on core 1 (`OnlineConfig.cpu_cores`), as on a GPU
  server where the learner gets spare host cores;
- shared: no pinning, everything competes for both cores of this machine.

This machine is a 2-vCPU VM whose step times drift with its host, so the pinned set-up runs three
times and every run is reported.

Writes benchmarks/results/dmlp_online_overhead.json and .png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BLOCK, BLOCKS = 50, 20
WIDTH, BATCH = 2560, 32


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scenario(pinned: bool) -> dict:
    """Runs in a fresh process: pins first (before jax starts its threads), then measures."""
    if pinned:
        os.sched_setaffinity(0, {0})
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer, num_inputs
    from stratum_jax.dmlp.model import DmlpConfig, Predictor, init_params
    from training.online import OnlineConfig, OnlineFineTuner

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    w1 = jax.random.normal(k1, (WIDTH, WIDTH)) * 0.02
    w2 = jax.random.normal(k2, (WIDTH, WIDTH)) * 0.02
    decode = jax.jit(lambda x: jnp.tanh(jnp.tanh(x @ w1) @ w2))

    rng = np.random.default_rng(0)
    raw = rng.uniform(0, 500, (20000, len(FEATURE_NAMES))).astype(np.float32)
    labels = (rng.random((20000, 5)) < 0.3).astype(np.float32)
    cfg = DmlpConfig(num_inputs())
    model = Predictor(cfg, init_params(cfg, 0), Normalizer.fit(raw))
    online_cfg = OnlineConfig(cpu_budget=0.25, cpu_cores=(1,) if pinned else None)
    tuner = OnlineFineTuner(model, online_cfg, tempfile.mkdtemp())
    tuner.observe(raw[:4000], labels[:4000])

    x = jnp.ones((BATCH, WIDTH))
    for _ in range(20):
        x = decode(x).block_until_ready()

    step = 0

    def run(n: int) -> list[float]:
        nonlocal x, step
        times = []
        for _ in range(n):
            t = time.perf_counter()
            x = decode(x).block_until_ready()
            j = (step * 32) % 19968
            tuner.observe(raw[j:j + 32], labels[j:j + 32])
            step += 1
            times.append(time.perf_counter() - t)
        return times

    tuner.start()
    while tuner.accuracy != tuner.accuracy:        # NaN until the worker's first round is done
        if tuner.error:
            raise RuntimeError(tuner.error)
        time.sleep(0.1)
    worker = tuner._process.pid
    on, off, on_cpu, on_wall, block_ratio = [], [], 0.0, 0.0, []
    for _ in range(BLOCKS):
        tuner.pause()
        time.sleep(0.5)                             # let a round in flight finish
        b_off = run(BLOCK)
        tuner.resume()
        cpu0, t0 = _cpu_seconds(worker), time.perf_counter()
        b_on = run(BLOCK)
        on_cpu += _cpu_seconds(worker) - cpu0
        on_wall += time.perf_counter() - t0
        off += b_off
        on += b_on
        block_ratio.append(np.median(b_on) / np.median(b_off))
    tuner.stop()
    med = lambda v: float(np.median(v) * 1e3)
    return {
        "pinned": pinned, "blocks": BLOCKS, "steps_per_block": BLOCK,
        "step_ms": {"off": med(off), "on": med(on)},
        "step_ms_p95": {"off": float(np.percentile(off, 95) * 1e3), "on": float(np.percentile(on, 95) * 1e3)},
        "overhead_pct_median": (med(on) / med(off) - 1.0) * 100.0,
        "overhead_pct_mean": (float(np.mean(on)) / float(np.mean(off)) - 1.0) * 100.0,
        "overhead_pct_median_of_block_pairs": (float(np.median(block_ratio)) - 1.0) * 100.0,
        "worker_cpu_share_of_one_core": on_cpu / on_wall,
        "cpu_budget": online_cfg.cpu_budget, "worker_updates": tuner.updates, "worker_error": tuner.error,
        "samples_ms": {"off": [t * 1e3 for t in off], "on": [t * 1e3 for t in on]},
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        ax.hist(r["samples_ms"]["off"], bins=50, alpha=0.6, label="fine-tuner off")
        ax.hist(r["samples_ms"]["on"], bins=50, alpha=0.6, label="fine-tuner on")
        ax.set_xlabel("stand-in decode step (ms)")
        ax.set_title(f"{'pinned' if r['pinned'] else 'shared cores'}: median overhead "
                     f"{r['overhead_pct_median']:+.1f}%", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("pinned", "shared"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.scenario:
        print(json.dumps(scenario(a.scenario == "pinned")))
        return 0
    results = []
    for name in ("pinned", "pinned", "pinned", "shared"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--scenario", name], cwd=ROOT,
                             check=True, stdout=subprocess.PIPE, text=True, timeout=600).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    import jax
    report = {"benchmark": "online fine-tuner overhead on a stand-in decode step",
              "decode_stand_in": f"jit(tanh(tanh(x[{BATCH},{WIDTH}] @ W1) @ W2)) + observe(32 pairs)",
              "machine": {"cpus": os.cpu_count(), "jax": jax.__version__},
              "date": datetime.date.today().isoformat(), "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    plot(results, os.path.join(RESULTS, "dmlp_online_overhead.png"))
    for r in results:
        r.pop("samples_ms")
    path = os.path.join(RESULTS, "dmlp_online_overhead.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    for r in results:
        s = r["step_ms"]
        print(f"{'pinned' if r['pinned'] else 'shared':7s} off {s['off']:.2f} ms  on {s['on']:.2f} ms  "
              f"overhead {r['overhead_pct_median']:+.2f}% (median), {r['overhead_pct_mean']:+.2f}% (mean), "
              f"{r['overhead_pct_median_of_block_pairs']:+.2f}% (median of block pairs); worker used "
              f"{r['worker_cpu_share_of_one_core']:.2f} of a core, {r['worker_updates']} swaps")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
