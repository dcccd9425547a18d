"""Online fine-tuning in a replay: the server's loop, driven by the replay's simulated clock.

The pieces are the server's own, wired as `stratum_jax/dmlp/runtime.py` wires them: the policy's
sampling of tracked blocks (`DmlpPolicy.track_accesses`, `--dmlp-online-track`), the live labels
(`OutcomeTracker`), the learner with its holdout swap rule and threshold calibration (`Learner`), and its
duty-cycle cadence (`RoundSchedule`), here through `InlineFineTuner` on simulated time instead of a
worker process on wall time.

What the learner sees does not depend on the cache: an access's features and its label come from the
access stream alone. So one pass over the stream gives the weights live at every access, whatever the
capacity, and each access's reuse curve is predicted by the weights live at that access. The cache
replays (`training/simulator.py::Predicted`) then use those curves, and learn of each swap through
`version`, so a guarded policy hears of each update (its ghost DMLP ranks with the live curves).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from tqdm import tqdm

from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp.online import InlineFineTuner, OnlineConfig
from stratum_jax.dmlp.policy import ConfidenceThreshold
from stratum_jax.dmlp.wiring import wire_policy
from training.dataset import Replay

# The replay's simulated ms a round is charged. The server measures a round's wall time; a replay has
# none. At the Mooncake benchmark's time scale (1000) one simulated ms is one second of the trace's
# own time, so with the default cpu_budget (0.25) the learner takes a round every 4 trace seconds:
# about 900 rounds in the trace's hour, fewer than a server on that traffic would (a round of the
# default learner takes well under a second), so the adaptation shown is not flattered.
DEFAULT_ROUND_MS = 1.0


@dataclasses.dataclass
class OnlineRun:
    """curves: float32 [E, H], P(reuse) of every access by the weights live then (the starting weights
    before `start`); version: int64 [E], the number of swaps live at each access; swap_ms: times of the
    swaps; rounds: rounds run; accuracy: holdout accuracy after each round, [(t_ms, accuracy)] (NaN while
    the holdout has no decided label at the decision horizon); refusals: rounds not judged because the
    holdout's decided labels at the decision horizon were one class (`Learner.round`); settings: the
    built policy's and tracker's (`WiredPolicy.settings`: decision horizon, hold_reuse), as the server's."""

    curves: np.ndarray
    version: np.ndarray
    swap_ms: list[float]
    rounds: int
    accuracy: list[tuple[float, float]]
    config: dict
    refusals: int = 0
    settings: dict = dataclasses.field(default_factory=dict)


def online_run(rep: Replay, predictor: Predictor, config: OnlineConfig = OnlineConfig(),
               round_ms: float = DEFAULT_ROUND_MS, track_fraction: float = 0.25,
               start: int | None = None) -> OnlineRun:
    """Replays `rep` once with online fine-tuning from event `start` on (default: its scored part, so the
    learner starts where the unseen workload does). `predictor` is not modified (a copy learns).
    The decision horizon and the label rule are `config`'s, wired as the server wires them
    (`wiring.wire_policy`)."""
    s, raw = rep.stream, rep.history.raw()
    start = rep.score_from if start is None else start
    live = Predictor(predictor.config, predictor.params, predictor.normalizer)
    threshold = ConfidenceThreshold()
    tuner = InlineFineTuner(live, config, round_s=round_ms / 1000.0, threshold=threshold)
    wired = wire_policy(live, threshold, config, sink=tuner.observe, track_fraction=track_fraction)
    policy = wired.policy
    E = s.num_events
    curves = np.zeros((E, len(predictor.config.horizons_ms)), np.float32)
    version = np.zeros(E, np.int64)
    swap_ms, accuracy, rounds = [], [], 0
    bounds = np.flatnonzero(np.diff(s.request)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [E]])
    pending = 0          # accesses from here on are not predicted yet (by the live weights)
    blocks = s.block.tolist()

    def predict_pending(upto: int) -> None:
        nonlocal pending
        for i in range(pending, upto, 16384):
            j = min(upto, i + 16384)
            curves[i:j] = live.predict(raw[i:j])
        version[pending:upto] = tuner.updates
        pending = upto

    for a, b in tqdm(list(zip(starts.tolist(), ends.tolist())), desc="online replay", unit="request",
                     leave=False, mininterval=1.0):
        if a < start:
            continue
        now = float(s.t_ms[a])
        if tuner.due(now / 1000.0):
            predict_pending(a)
            before = tuner.updates
            tuner.advance(now / 1000.0)
            rounds += 1
            accuracy.append((now, float(tuner.accuracy)))
            if tuner.updates != before:
                swap_ms.append(now)
        policy.track_accesses(blocks[a:b], raw[a:b], now)
    predict_pending(E)
    return OnlineRun(curves, version, swap_ms, rounds, accuracy,
                     {**dataclasses.asdict(config), "round_ms": round_ms, "track_fraction": track_fraction},
                     refusals=tuner.refusals, settings=wired.settings())
