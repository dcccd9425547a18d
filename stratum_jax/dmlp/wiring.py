"""The one place where a DMLP policy is wired to its live labels, for the server and the cache simulator alike.

    wired = wire_policy(predictor, threshold, config, sink=tuner.observe, track_fraction=..., guard=...)
    wired.policy, wired.tracker          # DmlpPolicy; OutcomeTracker (None without a sink)

`runtime.build_cache_policy` (the server) and `training/online_replay.py` (the replay) both call it, so
the settings the online learner is judged by and the ones the policy decides and labels with cannot drift
apart: the policy's decision horizon (hot/cold, prefetch, page size: what the threshold calibrated by the
learner refers to) is the learner's (`OnlineConfig.decision_horizon_ms`), and the tracker holds a reuse's
labels or not as `OnlineConfig.hold_reuse` says. Issue #15 found the replay and the server had come apart
on exactly these two.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from stratum_jax.dmlp.guard import ShadowLruGuard
from stratum_jax.dmlp.learner import OnlineConfig, decision_index
from stratum_jax.dmlp.outcomes import OutcomeTracker
from stratum_jax.dmlp.policy import ConfidenceThreshold, DmlpPolicy


@dataclasses.dataclass(frozen=True)
class WiredPolicy:
    policy: DmlpPolicy
    tracker: OutcomeTracker | None

    def settings(self) -> dict:
        """What the server and a replay must agree on, read from the built objects: the policy's decision
        horizon (ms) and, with a tracker, whether it holds reuses."""
        out = {"decision_horizon_ms": float(self.policy.horizons_ms[self.policy.decision_horizon])}
        if self.tracker is not None:
            out["hold_reuse"] = bool(self.tracker.hold_reuse)
        return out


def wire_policy(predictor, threshold: ConfidenceThreshold, config: OnlineConfig,
                sink: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                track_fraction: float = 1.0, guard: ShadowLruGuard | None = None,
                score_ahead: bool = True) -> WiredPolicy:
    """A `DmlpPolicy` deciding at `config`'s decision horizon, scoring lazily (`score_on_access=False`)
    with each step's accesses dispatched ahead (`score_ahead`: the curves are computed by the time a decision
    reads them, so the engine thread does not wait on the device for them), and,
    with `sink` (a fine-tuner's `observe`), an `OutcomeTracker` feeding it the tracked share of accesses
    (`track_fraction`) labelled as `config.hold_reuse` says."""
    horizons = predictor.config.horizons_ms
    tracker = None if sink is None else OutcomeTracker(horizons, sink, hold_reuse=config.hold_reuse)
    policy = DmlpPolicy(predictor, threshold, decision_horizon=decision_index(horizons, config.decision_horizon_ms),
                        on_access=tracker.accessed if tracker else None, score_on_access=False, score_ahead=score_ahead,
                        on_idle=tracker.idle if tracker else None, track_fraction=track_fraction, guard=guard)
    return WiredPolicy(policy, tracker)
