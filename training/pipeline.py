"""The two modes of `python -m stratum_jax.train_dmlp`: train (then evaluate on the held-out end of the
training traces) and evaluate a checkpoint on other traces. Both return the report dictionary."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from stratum_jax.dmlp.model import Predictor, count_params
from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, load_checkpoint, save_checkpoint
from training.dataset import eval_examples, train_val_examples
from stratum_jax.dmlp.online import OnlineConfig
from training.evaluate import example_metrics, policy_hit_rates
from training.online_replay import DEFAULT_ROUND_MS, online_run
from training.time_scale import choose_time_scale, flat_labels, warn_loudly
from training.trainer import TrainConfig, train
from training.traces import read_timeline, read_traces


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """capacity_fracs, host_frac: the replays' caches. guard: replay the DMLP also behind the shadow-LRU
    guard (`guard_window` accesses). online: also replay with the server's online fine-tuning on the
    simulated clock (`training/online_replay.py`), each round charged `online_round_ms`, tracking
    `online_track` of the blocks; `online_config`: the learner's settings (the server's by default).
    guard_after_warmup: also replay the guard judging from the scored part only (`policy_hit_rates`).
    The online decision horizon and label rule are `online_config`'s (the server's defaults)."""

    capacity_fracs: tuple[float, ...]
    host_frac: float
    guard: bool = True
    guard_window: int = 2048
    online: bool = False
    online_round_ms: float = DEFAULT_ROUND_MS
    online_track: float = 0.25
    online_config: OnlineConfig = OnlineConfig()
    guard_after_warmup: bool = False


def headline_horizon(horizons_ms, positive_rate) -> float:
    """The horizon whose positive rate is closest to 50% (decided on training data, stated up front)."""
    return float(horizons_ms[int(np.argmin(np.abs(np.asarray(positive_rate) - 0.5)))])


def run_train(traces: list[str], fmt: str, out_dir: str, horizons_ms, time_scale: float | None,
              val_fraction: float, cfg: TrainConfig, opts: EvalOptions) -> dict:
    """time_scale None: chosen from the traces (`training.time_scale`), printed and recorded."""
    t0 = time.perf_counter()
    streams = read_traces(traces, fmt, time_scale or 1.0)
    scale_info: dict = {"source": "--time-scale"}
    if time_scale is None:
        choice = choose_time_scale(streams, horizons_ms, val_fraction)
        time_scale = choice.scale
        streams = [s.rescaled(time_scale) for s in streams]
        scale_info = {"source": "chosen from the trace", "horizon_ms": choice.horizon_ms,
                      "positive_rate": choice.positive_rate, "val_known": choice.val_known,
                      "in_band": choice.in_band}
        print(f"time scale {time_scale:g} (chosen from the trace: the {choice.horizon_ms:g} ms horizon's "
              f"training positive rate is {choice.positive_rate:.3f}, {choice.val_known:.0%} of its "
              f"validation labels known; "
              f"--time-scale overrides)")
        if not choice.in_band:
            warn_loudly(f"no time scale puts the {choice.horizon_ms:g} ms horizon's positive rate in "
                        f"[0.2, 0.8] (closest: {choice.positive_rate:.3f} at {time_scale:g}); the labels "
                        f"may say little")
    tr, va, replays = train_val_examples(streams, horizons_ms, val_fraction)
    featurize_s = time.perf_counter() - t0
    print(f"{len(tr)} training / {len(va)} validation examples from {sum(s.num_events for s in streams)} "
          f"accesses ({featurize_s:.1f} s)")
    result = train(tr, va, horizons_ms, cfg)
    train_rate = (tr.labels * tr.known).sum(0) / np.maximum(tr.known.sum(0), 1)
    extra = {"time_scale": time_scale, "time_scale_choice": scale_info, "seed": cfg.seed,
             "traces": [os.path.basename(t) for t in traces],
             "format": fmt, "examples": len(tr), "train_seconds": result.seconds,
             "headline_horizon_ms": headline_horizon(horizons_ms, train_rate)}
    ckpt = DmlpCheckpoint(result.config, result.params, result.normalizer, extra)
    save_checkpoint(os.path.join(out_dir, "checkpoint"), ckpt)
    predictor = Predictor(result.config, result.params, result.normalizer)
    report = evaluation_report(predictor, ckpt, va, replays, opts)
    report["train"].update(epochs=result.epochs, best_epoch=result.best_epoch, featurize_seconds=featurize_s,
                           positive_rate=train_rate.tolist(),
                           config={k: v for k, v in dataclasses.asdict(cfg).items()})
    report["time_scale_choice"] = scale_info
    _flag_flat_labels(report, "training", train_rate)
    report["data"] = {"traces": traces, "format": fmt, "val_fraction": val_fraction,
                      "scored": "the last val_fraction of each trace's timeline"}
    write_report(report, os.path.join(out_dir, "report.json"))
    return report


def run_eval(checkpoint: str, traces: list[str], fmt: str, report_path: str, warmup: list[str],
             time_scale: float | None, opts: EvalOptions) -> dict:
    nested = os.path.join(checkpoint, "checkpoint")      # also accept a training --out directory
    if not os.path.exists(os.path.join(checkpoint, "meta.json")) and os.path.isdir(nested):
        checkpoint = nested
    ckpt = load_checkpoint(checkpoint)
    trained_scale = float(ckpt.extra.get("time_scale", 1.0))
    scale = trained_scale if time_scale is None else time_scale
    if scale != trained_scale:
        # The features (recency, age) are in simulated ms: another scale feeds the model inputs
        # on a scale it never saw. Allowed, for transfer experiments, but never silently.
        warn_loudly(f"--time-scale {scale:g} differs from the checkpoint's {trained_scale:g} "
                    f"({checkpoint}/meta.json); its features were learned at {trained_scale:g}")
    stream = read_timeline(list(warmup) + list(traces), fmt, scale)
    ex, rep = eval_examples(stream, stream.file_starts[len(warmup)], ckpt.config.horizons_ms)
    predictor = Predictor(ckpt.config, ckpt.params, ckpt.normalizer)
    report = evaluation_report(predictor, ckpt, ex, [rep], opts)
    report["time_scale"] = scale
    report["checkpoint_time_scale"] = trained_scale
    report["data"] = {"traces": traces, "format": fmt, "warmup": warmup, "checkpoint": checkpoint,
                      "scored": "every access of the traces (the warm-up only builds history and cache)"}
    write_report(report, report_path)
    return report


def evaluation_report(predictor: Predictor, ckpt: DmlpCheckpoint, ex, replays, opts: EvalOptions) -> dict:
    """The report of `predictor` (with the provenance of `ckpt`) on examples and replays."""
    metrics, calib = example_metrics(predictor, ex)
    runs = None
    if opts.online:
        runs = [online_run(r, predictor, opts.online_config, opts.online_round_ms, opts.online_track)
                for r in replays]
    report = {
        "params": count_params(ckpt.params),
        "horizons_ms": list(ckpt.config.horizons_ms),
        "time_scale": ckpt.extra.get("time_scale"),
        "headline_horizon_ms": ckpt.extra.get("headline_horizon_ms"),
        "train": {"examples": int(ckpt.extra.get("examples", 0)),
                  "seconds": float(ckpt.extra.get("train_seconds", 0.0))},
        "val": metrics,
        "calibration": calib,
        "policy": policy_hit_rates(replays, predictor, opts.capacity_fracs, opts.host_frac, guard=opts.guard,
                                   online=runs, guard_window=opts.guard_window,
                                   guard_after_warmup=opts.guard_after_warmup),
        "labels_flat": [],
    }
    if runs is not None:
        report["online"] = {"config": runs[0].config, "rounds": [r.rounds for r in runs],
                            "swaps": [len(r.swap_ms) for r in runs], "swap_ms": runs[0].swap_ms,
                            "refusals": [r.refusals for r in runs], "settings": runs[0].settings,
                            "holdout_accuracy": runs[0].accuracy[::max(1, len(runs[0].accuracy) // 200)]}
    _flag_flat_labels(report, "evaluation", metrics["positive_rate"])
    return report


def _flag_flat_labels(report: dict, which: str, positive_rate) -> None:
    """Warns and adds `which` to report["labels_flat"] when every horizon's positive rate is below 2% or
    above 98% (then accuracy equals the majority baseline and the policy ranks blocks like LRU)."""
    if flat_labels(positive_rate):
        rates = ", ".join(f"{r:.4f}" for r in positive_rate)
        warn_loudly(f"the {which} labels are flat: every horizon's positive rate is below 2% or above "
                    f"98% ({rates}); the model can only learn the majority answer. Pick a --time-scale that puts a horizon's rate in [0.2, 0.8] "
                    f"(or leave it out in training to have one chosen)")
        report["labels_flat"].append(which)


def write_report(report: dict, path: str) -> None:
    """Writes JSON atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, allow_nan=True)
    os.replace(tmp, path)
