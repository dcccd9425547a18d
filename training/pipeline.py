"""The two modes of `python -m stratum_jax.train_dmlp`: train (then evaluate on the held-out end of the
training traces) and evaluate a checkpoint on other traces. Both return the report dictionary."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from stratum_jax.dmlp.model import Predictor, count_params
from training.checkpoint import DmlpCheckpoint, load_checkpoint, save_checkpoint
from training.dataset import eval_examples, train_val_examples
from training.evaluate import example_metrics, policy_hit_rates
from training.trainer import TrainConfig, train
from training.traces import read_timeline, read_traces


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    capacity_fracs: tuple[float, ...]
    host_frac: float


def headline_horizon(horizons_ms, positive_rate) -> float:
    """The horizon whose positive rate is closest to 50% (decided on training data, stated up front)."""
    return float(horizons_ms[int(np.argmin(np.abs(np.asarray(positive_rate) - 0.5)))])


def run_train(traces: list[str], fmt: str, out_dir: str, horizons_ms, time_scale: float,
              val_fraction: float, cfg: TrainConfig, opts: EvalOptions) -> dict:
    t0 = time.perf_counter()
    streams = read_traces(traces, fmt, time_scale)
    tr, va, replays = train_val_examples(streams, horizons_ms, val_fraction)
    featurize_s = time.perf_counter() - t0
    print(f"{len(tr)} training / {len(va)} validation examples from {sum(s.num_events for s in streams)} "
          f"accesses ({featurize_s:.1f} s)")
    result = train(tr, va, horizons_ms, cfg)
    train_rate = (tr.labels * tr.known).sum(0) / np.maximum(tr.known.sum(0), 1)
    extra = {"time_scale": time_scale, "seed": cfg.seed, "traces": [os.path.basename(t) for t in traces],
             "format": fmt, "examples": len(tr), "train_seconds": result.seconds,
             "headline_horizon_ms": headline_horizon(horizons_ms, train_rate)}
    ckpt = DmlpCheckpoint(result.config, result.params, result.normalizer, extra)
    save_checkpoint(os.path.join(out_dir, "checkpoint"), ckpt)
    predictor = Predictor(result.config, result.params, result.normalizer)
    report = evaluation_report(predictor, ckpt, va, replays, opts)
    report["train"].update(epochs=result.epochs, best_epoch=result.best_epoch, featurize_seconds=featurize_s,
                           positive_rate=train_rate.tolist(),
                           config={k: v for k, v in dataclasses.asdict(cfg).items()})
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
    scale = ckpt.extra.get("time_scale", 1.0) if time_scale is None else time_scale
    stream = read_timeline(list(warmup) + list(traces), fmt, scale)
    ex, rep = eval_examples(stream, stream.file_starts[len(warmup)], ckpt.config.horizons_ms)
    predictor = Predictor(ckpt.config, ckpt.params, ckpt.normalizer)
    report = evaluation_report(predictor, ckpt, ex, [rep], opts)
    report["time_scale"] = scale
    report["data"] = {"traces": traces, "format": fmt, "warmup": warmup, "checkpoint": checkpoint,
                      "scored": "every access of the traces (the warm-up only builds history and cache)"}
    write_report(report, report_path)
    return report


def evaluation_report(predictor: Predictor, ckpt: DmlpCheckpoint, ex, replays, opts: EvalOptions) -> dict:
    """The report of `predictor` (with the provenance of `ckpt`) on examples and replays."""
    metrics, calib = example_metrics(predictor, ex)
    return {
        "params": count_params(ckpt.params),
        "horizons_ms": list(ckpt.config.horizons_ms),
        "time_scale": ckpt.extra.get("time_scale"),
        "headline_horizon_ms": ckpt.extra.get("headline_horizon_ms"),
        "train": {"examples": int(ckpt.extra.get("examples", 0)),
                  "seconds": float(ckpt.extra.get("train_seconds", 0.0))},
        "val": metrics,
        "calibration": calib,
        "policy": policy_hit_rates(replays, predictor, opts.capacity_fracs, opts.host_frac),
    }


def write_report(report: dict, path: str) -> None:
    """Writes JSON atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, allow_nan=True)
    os.replace(tmp, path)
