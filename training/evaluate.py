"""Evaluation: prediction metrics on examples and hit rates of LRU, LFU, DMLP and Belady on replays.

Capacities are fractions of the unique blocks among the scored accesses of a replay. The host tier
holds `host_frac` of them (0 = none). With several replays, hits and accesses are summed before the
rate is taken.
"""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp.policy import DmlpPolicy
from training.dataset import Replay
from training.labels import Examples
from training.metrics import calibration, horizon_metrics
from training.simulator import LFU, LRU, Belady, Predicted, SimResult, replay

DEFAULT_CAPACITY_FRACS = (0.05, 0.1, 0.2, 0.4)
POLICIES = ("lru", "lfu", "dmlp", "belady")


def predict_all(predictor: Predictor, raw: np.ndarray, batch: int = 8192) -> np.ndarray:
    """P(reuse) [N, H] for raw features [N, F], in fixed-size batches."""
    out = [predictor.predict(raw[i:i + batch]) for i in range(0, len(raw), batch)]
    return np.concatenate(out) if out else np.zeros((0, len(predictor.config.horizons_ms)), np.float32)


def example_metrics(predictor: Predictor, ex: Examples) -> tuple[dict, dict]:
    """Per-horizon metrics and per-horizon calibration curves (keyed by horizon in ms)."""
    probs = predict_all(predictor, ex.raw)
    metrics = horizon_metrics(probs, ex.labels, ex.known)
    calib = {}
    for k, h in enumerate(predictor.config.horizons_ms):
        m = ex.known[:, k] > 0
        calib[f"{h:g}"] = calibration(probs[m, k], ex.labels[m, k])
    return metrics, calib


def policy_hit_rates(replays: list[Replay], predictor: Predictor, capacity_fracs=DEFAULT_CAPACITY_FRACS,
                     host_frac: float = 0.0) -> dict:
    curves = [predict_all(predictor, r.history.raw()) for r in replays]
    totals = {p: [SimResult() for _ in capacity_fracs] for p in POLICIES}
    unique = [len(np.unique(r.stream.block[r.score_from:])) for r in replays]
    runs = [(i, p, ci) for ci in range(len(capacity_fracs)) for i in range(len(replays)) for p in POLICIES]
    for i, name, ci in tqdm(runs, desc="policies", unit="replay", leave=False):
        r = replays[i]
        cap = max(1, round(capacity_fracs[ci] * unique[i]))
        policy = {
            "lru": LRU, "lfu": LFU,
            "belady": lambda: Belady(r.history.next_event),
            "dmlp": lambda: Predicted(curves[i], r.stream.t_ms, DmlpPolicy(predictor).order_victims, cap),
        }[name]()
        res = replay(r.stream, cap, policy, host_capacity=round(host_frac * unique[i]), count_from=r.score_from)
        t = totals[name][ci]
        t.accesses += res.accesses
        t.hits += res.hits
        t.host_hits += res.host_hits
    hit = {p: [t.hit_rate for t in totals[p]] for p in POLICIES}
    gap = [(d - l) / (b - l) if b > l else float("nan")
           for d, l, b in zip(hit["dmlp"], hit["lru"], hit["belady"])]
    return {
        "capacity_frac": list(capacity_fracs),
        "hit_rate": hit,
        "host_hit_rate": {p: [t.host_hits / max(t.accesses, 1) for t in totals[p]] for p in POLICIES},
        "dmlp_gap_closed": gap,
        "unique_blocks": int(sum(unique)),
        "scored_accesses": int(totals["lru"][0].accesses),
        "host_frac": host_frac,
    }
