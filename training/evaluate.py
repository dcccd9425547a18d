"""Evaluation: prediction metrics on examples and hit rates of LRU, LFU, DMLP and Belady on replays.

Capacities are fractions of the unique blocks among the scored accesses of a replay. The host tier
holds `host_frac` of them (0 = none). With several replays, hits and accesses are summed before the
rate is taken.
"""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp.guard import ShadowLruGuard
from stratum_jax.dmlp.policy import DmlpPolicy
from training.dataset import Replay
from training.online_replay import OnlineRun
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


def guarded_policy(predictor: Predictor, guard: bool, window: int, judge_from_ms: float = -np.inf) -> DmlpPolicy:
    """The DMLP policy of a replay; with `guard`, its shadow-LRU guard (window in accesses; it neither
    trips nor returns before judge_from_ms)."""
    return DmlpPolicy(predictor, guard=ShadowLruGuard(window=window, judge_from_ms=judge_from_ms) if guard else None)


def policy_hit_rates(replays: list[Replay], predictor: Predictor, capacity_fracs=DEFAULT_CAPACITY_FRACS,
                     host_frac: float = 0.0, guard: bool = True, online: list[OnlineRun] | None = None,
                     guard_window: int = 2048, time_bins: int = 24, baselines=("lru", "lfu", "belady"),
                     guard_after_warmup: bool = False) -> dict:
    """Hit rates per policy and capacity. Policies: `baselines` (lru always, lfu and belady unless left
    out: a check that compares with LRU alone need not pay for them), dmlp (the offline model, no guard,
    as before the guard existed) and, with `guard`, dmlp_guarded (the same model behind the shadow-LRU
    guard). With `online` (one `OnlineRun` per replay): dmlp_online (the weights fine-tuned online, behind
    the guard when `guard`) and, with the guard, dmlp_online_unguarded. `over_time` holds each policy's
    hit rate per time bin of the scored part (the first replay only) and the guard's trips and returns.
    guard_after_warmup (with `guard`): also dmlp_guarded_after_warmup, the guard fed by the warm-up (its
    ghosts and windows) but judging only from the scored part on, to show whether the warm-up should
    reach the guard's decisions."""
    curves = [predict_all(predictor, r.history.raw()) for r in replays]
    unknown = set(baselines) - set(POLICIES)
    if "lru" not in baselines or unknown:
        raise ValueError(f"baselines must include lru and be among lru, lfu, belady; got {baselines}")
    policies = [p for p in POLICIES if p in baselines or p == "dmlp"] + (["dmlp_guarded"] if guard else [])
    policies += ["dmlp_guarded_after_warmup"] if guard and guard_after_warmup else []
    if online is not None:
        policies += ["dmlp_online"] + (["dmlp_online_unguarded"] if guard else [])
    totals = {p: [SimResult() for _ in capacity_fracs] for p in policies}
    unique = [len(np.unique(r.stream.block[r.score_from:])) for r in replays]
    r0 = replays[0]
    edges = np.linspace(r0.stream.t_ms[r0.score_from], r0.stream.t_end_ms, time_bins + 1)
    bin_of = np.clip(np.searchsorted(edges, r0.stream.t_ms[r0.score_from:], side="right") - 1, 0, time_bins - 1)
    per_bin = np.bincount(bin_of, minlength=time_bins)
    over_time = {"t_ms": ((edges[:-1] + edges[1:]) / 2).tolist(), "hit_rate": {p: [] for p in policies},
                 "guard_trips": {p: [] for p in policies if "guarded" in p or p == "dmlp_online"},
                 "guard_returns": {p: [] for p in policies if "guarded" in p or p == "dmlp_online"},
                 "guard_ghost_rankings": {p: [] for p in policies if "guarded" in p or p == "dmlp_online"}}
    runs = [(i, p, ci) for ci in range(len(capacity_fracs)) for i in range(len(replays)) for p in policies]
    for i, name, ci in tqdm(runs, desc="policies", unit="replay", leave=False):
        r = replays[i]
        cap = max(1, round(capacity_fracs[ci] * unique[i]))
        pol = None
        if name == "lru":
            policy = LRU()
        elif name == "lfu":
            policy = LFU()
        elif name == "belady":
            policy = Belady(r.history.next_event)
        else:
            guarded = name.startswith("dmlp_guarded") or (name == "dmlp_online" and guard)
            judge_from = r.stream.t_ms[r.score_from] if name == "dmlp_guarded_after_warmup" else -np.inf
            pol = guarded_policy(predictor, guarded, guard_window, judge_from)
            run = online[i] if name.startswith("dmlp_online") else None
            policy = Predicted(curves[i] if run is None else run.curves, r.stream.t_ms, pol.order_victims, cap,
                               observer=pol if guarded else None, version=None if run is None else run.version)
        hits = np.zeros(r.stream.num_events, bool)
        res = replay(r.stream, cap, policy, host_capacity=round(host_frac * unique[i]), count_from=r.score_from,
                     hit_events=hits)
        t = totals[name][ci]
        t.accesses += res.accesses
        t.hits += res.hits
        t.host_hits += res.host_hits
        if i == 0:
            rate = np.bincount(bin_of, weights=hits[r.score_from:], minlength=time_bins) / np.maximum(per_bin, 1)
            over_time["hit_rate"][name].append(rate.tolist())
            if name in over_time["guard_trips"]:
                over_time["guard_trips"][name].append(pol.guard.trips if pol.guard is not None else 0)
                over_time["guard_returns"][name].append(pol.guard.returns if pol.guard is not None else 0)
                over_time["guard_ghost_rankings"][name].append(pol.guard.ghost.rankings if pol.guard is not None else 0)
    hit = {p: [t.hit_rate for t in totals[p]] for p in policies}
    gap = [(d - l) / (b - l) if b > l else float("nan")
           for d, l, b in zip(hit["dmlp"], hit["lru"], hit.get("belady", hit["lru"]))]
    return {
        "capacity_frac": list(capacity_fracs),
        "hit_rate": hit,
        "host_hit_rate": {p: [t.host_hits / max(t.accesses, 1) for t in totals[p]] for p in policies},
        "dmlp_gap_closed": gap,
        "unique_blocks": int(sum(unique)),
        "scored_accesses": int(totals["lru"][0].accesses),
        "host_frac": host_frac,
        "guard": {"on": True, **guarded_policy(predictor, True, guard_window).guard.settings()} if guard else {"on": False},
        "over_time": over_time,
    }
