"""DMLP on the shared Mooncake conversation trace: train on the early timeline, evaluate on the later one.

    python benchmarks/dmlp_mooncake.py [--trace PATH] [--skip-whole-trace]
    python benchmarks/dmlp_mooncake.py --shifted [--trace PATH]      # issue #15: a workload shift

--shifted: trains on the early 60% (a smaller MLP, so that the online replay fits a few minutes of
2 CPU cores), then evaluates (a) on the later 40% as it is and (b) on a shifted workload derived from it
(`training/shift.py`: arrivals 3x as dense, 8 Zipf system prompts of 4 blocks instead of the one shared
block, 30% synthetic conversations mixed in; seed 0), each with offline, guarded and online replays
beside LRU, LFU and Belady. Writes benchmarks/results/dmlp_shift_held_out.json, dmlp_shift_shifted.json
and dmlp_shift_over_time.png. `--parts held_out` / `--parts shifted` run one part (two processes can run
them side by side); `--no-shifted-warmup` scores the shifted workload from an empty cache and history.

1. Splits the trace by time: the first 60% of its timeline trains, the last 40% evaluates. The trainer
   never sees a line of the later part (its own validation split is the end of the early part).
2. Trains with `python -m stratum_jax.train_dmlp` defaults at time scale 1000 (1 trace second = 1
   simulated ms, so the horizons 10..500 ms cover 10 s..8.3 min of conversation think time).
3. Evaluates the checkpoint on the later part, with the early part replayed first as warm-up only.
4. Times training on the whole trace (the <= 10 minute budget), and measures inference speed.
Writes benchmarks/results/dmlp_mooncake_report.json, dmlp_mooncake_hit_rate.png and
dmlp_mooncake_calibration.png, and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from stratum_jax.dmlp.features import FEATURE_NAMES                      # noqa: E402
from stratum_jax.dmlp.model import Predictor                             # noqa: E402
from stratum_jax.dmlp.learner import OnlineConfig                          # noqa: E402
from stratum_jax.dmlp.policy import reuse_before_eviction                # noqa: E402
from stratum_jax.dmlp.checkpoint import load_checkpoint                          # noqa: E402
from training.pipeline import EvalOptions, run_eval, run_train, write_report  # noqa: E402
from training.trainer import TrainConfig                                 # noqa: E402

TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation.jsonl")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TIME_SCALE = 1000.0
TRAIN_SHARE = 0.6
CAPACITY_FRACS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6)
HOST_FRAC = 0.2
TARGET_ACCURACY, TARGET_AUC, TARGET_GAP = 0.923, 0.85, 0.5
MIN_BIN = 200          # calibration bins with fewer accesses are too noisy to draw


def split_by_time(trace: str, out_dir: str) -> dict:
    """Writes train.jsonl (timestamps before the cut) and eval.jsonl (the rest)."""
    lines = open(trace).read().splitlines()
    ts = [json.loads(l)["timestamp"] for l in lines]
    cut = ts[0] + TRAIN_SHARE * (ts[-1] - ts[0])
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "eval": os.path.join(out_dir, "eval.jsonl")}
    with open(paths["train"], "w") as a, open(paths["eval"], "w") as b:
        for line, t in zip(lines, ts):
            (a if t < cut else b).write(line + "\n")
    n_train = sum(t < cut for t in ts)
    return {**paths, "cut_ms": cut, "train_requests": n_train, "eval_requests": len(ts) - n_train}


def inference_speed(ckpt_dir: str) -> dict:
    """Predictor throughput on this machine, and the cost of eviction scoring over a large cache."""
    ck = load_checkpoint(ckpt_dir)
    pred = Predictor(ck.config, ck.params, ck.normalizer)
    raw = np.random.default_rng(0).uniform(0, 100, (65536, len(FEATURE_NAMES))).astype(np.float32)
    pred.predict(raw)                                          # compile
    t = time.perf_counter()
    for _ in range(3):
        pred.predict(raw)
    predict_s = (time.perf_counter() - t) / 3
    small = raw[:32]
    pred.predict(small)
    t = time.perf_counter()
    for _ in range(100):
        pred.predict(small)
    per_request_ms = (time.perf_counter() - t) / 100 * 1e3
    curves = pred.predict(raw[:8192])
    curves = np.tile(curves, (13, 1))[:100_000].astype(np.float64)
    idle = np.random.default_rng(1).uniform(0, 1000, len(curves))
    t = time.perf_counter()
    for _ in range(10):
        np.argsort(reuse_before_eviction(curves, ck.config.horizons_ms, idle, 200.0))
    evict_ms = (time.perf_counter() - t) / 10 * 1e3
    import jax
    dev = jax.devices()[0]
    where = f"cpu ({os.cpu_count()} cores)" if dev.platform == "cpu" else f"{dev.platform}: {dev.device_kind}"
    return {"device": where, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
            "predict_blocks_per_s": 65536 / predict_s,
            "predict_65536_blocks_s": predict_s, "predict_32_blocks_ms": per_request_ms,
            "evict_rank_100k_cached_blocks_ms": evict_ms,
            "note": "the model runs once per block access (batched per request); evictions rank stored "
                    "curves without running it"}


def whole_trace_training(trace: str, out_dir: str) -> dict:
    cmd = [sys.executable, "-m", "stratum_jax.train_dmlp", "--traces", trace, "--format", "mooncake",
           "--out", out_dir, "--time-scale", str(TIME_SCALE)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    rep = json.load(open(os.path.join(out_dir, "report.json")))
    shown = [os.path.relpath(a, ROOT) if a == trace else "<tmp>" if a == out_dir else a for a in cmd[1:]]
    return {"command": " ".join(shown), "wall_seconds": wall, "train_loop_seconds": rep["train"]["seconds"],
            "featurize_seconds": rep["train"]["featurize_seconds"], "examples": rep["train"]["examples"]}


def summarize(report: dict) -> dict:
    pol, val = report["policy"], report["val"]
    hit = pol["hit_rate"]
    h = report["headline_horizon_ms"]
    k = report["horizons_ms"].index(h)
    margins = [d - l for d, l in zip(hit["dmlp"], hit["lru"])]
    i01 = pol["capacity_frac"].index(0.1)
    return {
        "headline_horizon_ms": h,
        "headline": {m: val[m][k] for m in ("positive_rate", "accuracy", "majority_accuracy", "auc", "brier")},
        "targets": {
            "headline_positive_rate_in_20_80": 0.2 <= val["positive_rate"][k] <= 0.8,
            "accuracy_ge_0.923": val["accuracy"][k] >= TARGET_ACCURACY,
            "accuracy_shortfall": TARGET_ACCURACY - val["accuracy"][k],
            "auc_ge_0.85": val["auc"][k] >= TARGET_AUC,
            "auc_shortfall": TARGET_AUC - val["auc"][k],
            "dmlp_ge_lru_at_every_capacity": all(m >= 0 for m in margins),
            "dmlp_minus_lru": margins,
            "gap_closed_at_0.1": pol["dmlp_gap_closed"][i01],
            "gap_closed_at_0.1_ge_0.5": pol["dmlp_gap_closed"][i01] >= TARGET_GAP,
        },
    }


def plot(report: dict, path_hit: str, path_cal: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = report["policy"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, style in (("belady", "k--"), ("dmlp", "o-"), ("lru", "s-"), ("lfu", "^-")):
        ax.plot(pol["capacity_frac"], pol["hit_rate"][name], style, label=name.upper() if name != "belady"
                else "Belady (oracle)")
    ax.set_xlabel("HBM capacity (fraction of the evaluated part's unique blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_title(f"Mooncake conversation trace, last 40% of the timeline\ntime scale {report['time_scale']:g}x, "
                 f"trained on the first 60%", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path_hit, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.4, 5.0))
    ax.plot([0, 1], [0, 1], "k:", label="perfect calibration")
    for h, c in report["calibration"].items():
        keep = [i for i, n in enumerate(c["count"]) if n >= MIN_BIN]
        ax.plot([c["mean_predicted"][i] for i in keep], [c["observed_rate"][i] for i in keep], "o-", ms=3,
                label=f"{h} ms")
    ax.set_xlabel("predicted P(reuse within h)")
    ax.set_ylabel("observed reuse rate")
    ax.set_title(f"DMLP calibration on the evaluated part (bins with >= {MIN_BIN} accesses)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_cal, dpi=120)
    plt.close(fig)


SHIFT = dict(rate=3.0, system_prompts=8, system_blocks=4, mix=0.3, seed=0)
SHIFT_CAPACITIES = (0.05, 0.1, 0.2, 0.4)
SHIFT_MODEL = TrainConfig(epochs=2, hidden=(256, 256, 64))
SHIFT_ROUND_MS = 2.0      # one round every 8 trace seconds (time scale 1000, cpu budget 0.25)


PARTS = ("held_out", "shifted")
DEFAULT_ONLINE = OnlineConfig()     # the server's online settings


def shifted(trace: str, parts=PARTS, shifted_warmup: bool = True, suffix: str = "",
            online_config: OnlineConfig = OnlineConfig()) -> int:
    """Issue #15: held-out part and a shifted workload, offline / guarded / online beside the baselines.
    parts: which to evaluate (each writes its own JSON, so two processes can run them side by side);
    shifted_warmup: replay the training part before the shifted workload as warm-up (history and cache),
    as the held-out part is; without it the shifted workload starts from an empty cache and history.
    suffix: appended to the output file names (dmlp_shift_<part><suffix>.json), so a re-run keeps earlier ones.
    online_config: the online learner's settings, the server's defaults unless an experiment changes its
    decision horizon or label rule (`OnlineConfig.decision_horizon_ms`, `hold_reuse`)."""
    import jax

    from training.report_plot import plot_over_time
    from training.shift import ShiftSpec, derive, read_records
    from training.synthetic import write_jsonl
    # The held-out part is the workload the model was trained for: its offline and guarded replays show
    # the guard costs nothing there. The online replays (two more DMLP replays per capacity) are run
    # where the online target is, on the shifted workload.
    # The held-out part also replays the guard judging from the scored part only (fed by the warm-up, but
    # no trip or return in it): whether the warm-up replay should reach the guard's decisions (#15).
    opts = {"held_out": EvalOptions(SHIFT_CAPACITIES, 0.0, guard=True, online=False, guard_after_warmup=True),
            "shifted": EvalOptions(SHIFT_CAPACITIES, 0.0, guard=True, online=True, online_round_ms=SHIFT_ROUND_MS,
                                   online_config=online_config)}
    dev = jax.devices()[0]
    with tempfile.TemporaryDirectory() as tmp:
        split = split_by_time(trace, tmp)
        t = time.perf_counter()
        run_train([split["train"]], "mooncake", os.path.join(tmp, "run"), (10.0, 50.0, 100.0, 200.0, 500.0),
                  TIME_SCALE, 0.25, SHIFT_MODEL, EvalOptions((0.1,), 0.0, guard=False))
        train_seconds = time.perf_counter() - t
        ckpt = os.path.join(tmp, "run", "checkpoint")
        shifted_path = os.path.join(tmp, "shifted.jsonl")
        write_jsonl(shifted_path, derive(read_records(split["eval"]), ShiftSpec(**SHIFT)))
        for name in parts:
            path = split["eval"] if name == "held_out" else shifted_path
            warm = name == "held_out" or shifted_warmup
            t = time.perf_counter()
            rep = run_eval(ckpt, [path], "mooncake", os.path.join(tmp, f"{name}.json"),
                           [split["train"]] if warm else [], None, opts[name])
            rep["wall_seconds"] = time.perf_counter() - t
            rep["data"].update(traces=[f"{name}.jsonl"], checkpoint="trained on train.jsonl",
                               warmup=["train.jsonl: the first 60% (history only)"] if warm else [])
            hit = rep["policy"]["hit_rate"]
            print(f"\n{name} ({rep['wall_seconds']:.0f} s): capacity " + " ".join(f"{c:7.2f}" for c in SHIFT_CAPACITIES))
            for p, rates in hit.items():
                print(f"  {p:22s} " + " ".join(f"{x:7.4f}" for x in rates))
            rep["benchmark"] = {
                "command": f"python benchmarks/dmlp_mooncake.py --shifted --parts {name}"
                           + ("" if warm or name == "held_out" else " --no-shifted-warmup")
                           + (f" --suffix {suffix}" if suffix else "")
                           + (f" --online-decision-horizon-ms {online_config.decision_horizon_ms:g}"
                              if online_config.decision_horizon_ms != DEFAULT_ONLINE.decision_horizon_ms else "")
                           + ((" --online-hold-reuse" if online_config.hold_reuse else " --no-online-hold-reuse")
                              if online_config.hold_reuse != DEFAULT_ONLINE.hold_reuse else ""),
                "part": name, "trace": os.path.relpath(os.path.abspath(trace), ROOT), "time_scale": TIME_SCALE,
                "train_share_of_timeline": TRAIN_SHARE, "warmup": warm, "model": dataclasses.asdict(SHIFT_MODEL),
                "train_seconds": train_seconds, "capacities": SHIFT_CAPACITIES,
                **({"shift": SHIFT, "online_round_ms": SHIFT_ROUND_MS} if name == "shifted" else {}),
                "device": f"cpu ({os.cpu_count()} cores)" if dev.platform == "cpu" else dev.device_kind,
                "jax": jax.__version__, "date": datetime.date.today().isoformat(), "platform": platform.platform(),
                "targets": shift_targets(rep["policy"]),
            }
            path = os.path.join(RESULTS, f"dmlp_shift_{name}{suffix}.json")
            write_report(rep, path)
            print(json.dumps(rep["benchmark"]["targets"], indent=1))
            print(f"wrote {path}", flush=True)
            if name == "shifted":
                plot_over_time(rep, os.path.join(RESULTS, f"dmlp_shift_over_time{suffix}.png"), SHIFT_CAPACITIES,
                               title="Shifted Mooncake workload (3x arrivals, 8 system prompts, 30% synthetic): "
                                     "hit rate over time; grey lines = online weight swaps")
    return 0


def shift_targets(pol: dict) -> dict:
    """Issue #15's targets on one report's policy section (hit rates as fractions)."""
    hit, lru = pol["hit_rate"], pol["hit_rate"]["lru"]
    i01 = pol["capacity_frac"].index(0.1)
    margin = lambda name: [round(100 * (d - l), 3) for d, l in zip(hit[name], lru)]
    return {
        "points_vs_lru": {name: margin(name) for name in hit if name.startswith("dmlp")},
        "guarded_ge_lru_minus_0.5_everywhere": all(m >= -0.5 for m in margin("dmlp_guarded")),
        "offline_ge_lru_everywhere": all(m >= 0 for m in margin("dmlp")),
        **({"online_ge_lru_minus_0.5_everywhere": all(m >= -0.5 for m in margin("dmlp_online")),
            "online_ge_lru_plus_1_at_0.1": margin("dmlp_online")[i01] >= 1.0} if "dmlp_online" in hit else {}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--skip-whole-trace", action="store_true", help="do not time training on the whole trace")
    ap.add_argument("--shifted", action="store_true", help="issue #15's shifted-workload evaluation instead")
    ap.add_argument("--parts", default=",".join(PARTS), help="with --shifted: held_out, shifted or both")
    ap.add_argument("--shifted-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="with --shifted: replay the training part before the shifted workload (default on)")
    ap.add_argument("--suffix", default="", help="with --shifted: appended to the output file names")
    ap.add_argument("--online-decision-horizon-ms", type=float, default=DEFAULT_ONLINE.decision_horizon_ms,
                    help="with --shifted, an experiment: the online decision horizon in ms (the longest of the "
                         f"model's not longer than this; default {DEFAULT_ONLINE.decision_horizon_ms:g}, the server's)")
    ap.add_argument("--online-hold-reuse", action=argparse.BooleanOptionalAction, default=DEFAULT_ONLINE.hold_reuse,
                    help="with --shifted, an experiment: whether the online labels of a reuse wait for each "
                         f"horizon's deadline (default {'on' if DEFAULT_ONLINE.hold_reuse else 'off'}, the server's)")
    a = ap.parse_args()
    if a.shifted:
        os.makedirs(RESULTS, exist_ok=True)
        parts = tuple(p for p in a.parts.split(",") if p)
        if not parts or set(parts) - set(PARTS):
            ap.error(f"--parts must name some of {', '.join(PARTS)}, got {a.parts!r}")
        if not all(c.isalnum() or c in "_-." for c in a.suffix):
            ap.error(f"--suffix may hold letters, digits, '_', '-' and '.' only, got {a.suffix!r}")
        if not a.online_decision_horizon_ms > 0:
            ap.error(f"--online-decision-horizon-ms must be > 0 (ms), got {a.online_decision_horizon_ms:g}")
        return shifted(a.trace, parts, a.shifted_warmup, a.suffix,
                       dataclasses.replace(DEFAULT_ONLINE, decision_horizon_ms=a.online_decision_horizon_ms,
                                           hold_reuse=a.online_hold_reuse))
    os.makedirs(RESULTS, exist_ok=True)
    opts = EvalOptions(CAPACITY_FRACS, HOST_FRAC)
    with tempfile.TemporaryDirectory() as tmp:
        split = split_by_time(a.trace, tmp)
        t = time.perf_counter()
        train_report = run_train([split["train"]], "mooncake", os.path.join(tmp, "run"), (10.0, 50.0, 100.0, 200.0, 500.0),
                                 TIME_SCALE, 0.25, TrainConfig(), opts)
        train_wall = time.perf_counter() - t
        ckpt = os.path.join(tmp, "run", "checkpoint")
        report = run_eval(ckpt, [split["eval"]], "mooncake", os.path.join(tmp, "eval.json"), [split["train"]],
                          None, opts)
        # The split files live in a temporary directory: record what they are, not where they were.
        report["data"].update(traces=["eval.jsonl: the last 40% of the timeline"],
                              warmup=["train.jsonl: the first 60% (history only)"],
                              checkpoint="trained on train.jsonl")
        report["benchmark"] = {
            "trace": os.path.relpath(os.path.abspath(a.trace), ROOT),
            "split": {"train_share_of_timeline": TRAIN_SHARE, **{k: v for k, v in split.items()
                                                                  if k not in ("train", "eval")}},
            "time_scale": TIME_SCALE,
            "train_run": {"wall_seconds": train_wall, "val_fraction": 0.25, "best_epoch": train_report["train"]["best_epoch"],
                          "epochs": train_report["train"]["epochs"], "val": train_report["val"],
                          "val_policy": train_report["policy"]},
            "inference": inference_speed(ckpt),
            "whole_trace_training": None if a.skip_whole_trace else whole_trace_training(a.trace, os.path.join(tmp, "whole")),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "jax": __import__("jax").__version__},
            "date": datetime.date.today().isoformat(),
        }
        report["benchmark"].update(summarize(report))
    out = os.path.join(RESULTS, "dmlp_mooncake_report.json")
    write_report(report, out)
    plot(report, os.path.join(RESULTS, "dmlp_mooncake_hit_rate.png"), os.path.join(RESULTS, "dmlp_mooncake_calibration.png"))
    b, pol = report["benchmark"], report["policy"]
    print(f"\nDMLP on {b['trace']} (eval on the last 40% of the timeline, time scale {TIME_SCALE:g}x)")
    print("capacity  " + "  ".join(f"{c:>6.2f}" for c in pol["capacity_frac"]))
    for name in ("lru", "lfu", "dmlp", "belady"):
        print(f"{name:8s}  " + "  ".join(f"{x:6.4f}" for x in pol["hit_rate"][name]))
    print("gap closed" + "  ".join(f"{x:6.3f}" for x in pol["dmlp_gap_closed"]))
    print(f"headline horizon {b['headline_horizon_ms']:g} ms: " +
          ", ".join(f"{k} {v:.4f}" for k, v in b["headline"].items()))
    print(json.dumps(b["targets"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
