"""`python -m stratum_jax.train_dmlp`: train the DMLP reuse predictor on traces, or evaluate a checkpoint.

Train:     --traces PATH [PATH...] --format {stratum,mooncake} --out DIR [--horizons-ms H ...]
           [--time-scale X (default: chosen from the trace)] [--epochs N] [--seed S] [--val-fraction F]
           writes DIR/checkpoint (orbax) and DIR/report.json
Evaluate:  --eval-only --checkpoint DIR --traces PATH [PATH...] --format F --report OUT.json
           [--warmup-traces PATH ...] [--online [--online-round-ms MS] [--online-track F]] [--no-guard]
           --online replays the traces with the server's online fine-tuning on simulated time and adds
           policy.hit_rate.dmlp_online and OUT_over_time.png (hit rate over time)
The work is done in training/ (pipeline.py); this module only parses flags.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from stratum_jax.dmlp.model import DEFAULT_HORIZONS_MS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stratum_jax.train_dmlp", description=__doc__.split("\n")[0])
    p.add_argument("--traces", nargs="+", required=True, help="trace files (each its own timeline)")
    p.add_argument("--format", choices=("stratum", "mooncake"), required=True)
    p.add_argument("--out", help="output directory (train mode)")
    p.add_argument("--horizons-ms", nargs="+", type=float, default=list(DEFAULT_HORIZONS_MS))
    p.add_argument("--time-scale", type=float, default=None,
                   help="simulated ms = trace ms / X (1000 replays 1000x faster); default: chosen from "
                        "the trace so the 500 ms horizon's positive rate is informative (printed and "
                        "saved in meta.json), or the checkpoint's in --eval-only")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="validation = the last F of each trace's timeline")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--capacity-fracs", nargs="+", type=float, default=[0.05, 0.1, 0.2, 0.4],
                   help="HBM capacities for the policy replay, as fractions of the scored unique blocks")
    p.add_argument("--host-frac", type=float, default=0.0,
                   help="host-tier capacity as a fraction of the scored unique blocks (0 = no host tier)")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--checkpoint", help="checkpoint directory (eval mode)")
    p.add_argument("--report", help="report path (eval mode)")
    p.add_argument("--warmup-traces", nargs="*", default=[],
                   help="eval mode: earlier parts of the same timeline, replayed first and not scored")
    p.add_argument("--online", action="store_true",
                   help="eval mode: also replay with the server's online fine-tuning (labels, sampling, "
                        "cadence and swap rule of --dmlp-online) on the replay's simulated clock")
    p.add_argument("--online-round-ms", type=float, default=None,
                   help="simulated ms each online round is charged (sets the cadence with the learner's "
                        "cpu budget); default 1.0")
    p.add_argument("--online-track", type=float, default=None,
                   help="share of blocks whose accesses become online examples (as --dmlp-online-track); "
                        "default 0.25")
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True,
                   help="also replay the DMLP behind the shadow-LRU guard (on by default; the online "
                        "replay uses it too)")
    p.add_argument("--guard-window", type=int, default=2048, help="the guard's window, in block accesses")
    a = p.parse_args(argv)
    if a.online and not a.eval_only:
        p.error("--online applies to --eval-only (training evaluates offline on its own held-out part)")
    for flag, value in (("--online-round-ms", a.online_round_ms), ("--online-track", a.online_track)):
        if value is not None and not a.online:
            p.error(f"{flag} applies to --online replays: add --online or drop {flag}")
    if a.online_round_ms is not None and not 0 < a.online_round_ms < math.inf:
        p.error("--online-round-ms must be > 0")
    if a.online_track is None:
        a.online_track = 0.25
    if not 0.0 < a.online_track <= 1.0:
        p.error("--online-track must lie in (0, 1]")
    if a.guard_window < 1:
        p.error("--guard-window must be >= 1")
    if a.eval_only:
        if not a.checkpoint or not a.report:
            p.error("--eval-only needs --checkpoint and --report")
        if a.out:
            p.error("--out is where training writes; --eval-only writes only --report: drop one of them")
        report_dir = os.path.dirname(os.path.abspath(a.report))
        if os.path.isdir(a.report) or not os.path.isdir(report_dir):
            p.error(f"--report {a.report}: give a file path in an existing directory")
    else:
        if not a.out:
            p.error("training needs --out DIR (or use --eval-only)")
        if os.path.exists(a.out) and not os.path.isdir(a.out):
            p.error(f"--out {a.out}: is a file; give a directory (created if missing)")
        for flag, value in (("--checkpoint", a.checkpoint), ("--report", a.report),
                            ("--warmup-traces", a.warmup_traces)):
            if value:
                p.error(f"{flag} applies to --eval-only (training writes --out DIR/checkpoint and "
                        f"DIR/report.json): add --eval-only or drop {flag}")
    if a.epochs < 1:
        p.error("--epochs must be >= 1")
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {a.batch_size}")
    if not 0 < a.learning_rate < math.inf:
        p.error(f"--learning-rate must be a finite number > 0, got {a.learning_rate}")
    if a.seed < 0:
        p.error(f"--seed must be >= 0, got {a.seed}")
    hs = a.horizons_ms
    if not all(0 < h < math.inf for h in hs) or any(x >= y for x, y in zip(hs, hs[1:])):
        p.error(f"--horizons-ms must be finite numbers > 0 in increasing order, got {' '.join(map(str, hs))}")
    if not all(0 < c <= 1 for c in a.capacity_fracs):
        p.error(f"--capacity-fracs must lie in (0, 1] (shares of the scored unique blocks), got "
                f"{' '.join(map(str, a.capacity_fracs))}")
    if not 0 <= a.host_frac < math.inf:
        p.error(f"--host-frac must be a finite number >= 0, got {a.host_frac}")
    if a.time_scale is not None and not 0 < a.time_scale < math.inf:
        p.error("--time-scale must be a finite number > 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # Imported here so that --help answers without loading jax.
    from stratum_jax.dmlp.checkpoint import CheckpointError
    from training.pipeline import EvalOptions, run_eval, run_train
    from training.trainer import TrainConfig
    from training.traces import TraceFormatError

    from training.online_replay import DEFAULT_ROUND_MS

    opts = EvalOptions(tuple(a.capacity_fracs), a.host_frac, guard=a.guard, guard_window=a.guard_window,
                       online=a.online, online_round_ms=a.online_round_ms or DEFAULT_ROUND_MS,
                       online_track=a.online_track)
    try:
        if a.eval_only:
            report = run_eval(a.checkpoint, a.traces, a.format, a.report, a.warmup_traces, a.time_scale, opts)
            if a.online:
                from training.report_plot import plot_over_time
                png = os.path.splitext(a.report)[0] + "_over_time.png"
                plot_over_time(report, png, tuple(a.capacity_fracs))
                print(f"wrote {png}")
        else:
            cfg = TrainConfig(epochs=a.epochs, seed=a.seed, batch_size=a.batch_size,
                              learning_rate=a.learning_rate)
            report = run_train(a.traces, a.format, a.out, a.horizons_ms, a.time_scale,
                               a.val_fraction, cfg, opts)
    except (TraceFormatError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    v, pol = report["val"], report["policy"]
    print(f"params {report['params']:,}; horizons {report['horizons_ms']} ms; time scale "
          f"{report['time_scale']:g}")
    for k in ("positive_rate", "accuracy", "majority_accuracy", "auc", "brier"):
        print(f"  {k:18s} " + " ".join(f"{x:.4f}" for x in v[k]))
    print("  capacity           " + " ".join(f"{x:.2f}" for x in pol["capacity_frac"]))
    for name, rates in pol["hit_rate"].items():
        print(f"  hit rate {name:9s} " + " ".join(f"{x:.4f}" for x in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
