"""From trace files to train/validation examples, split by time.

Each trace is its own timeline. Validation takes the accesses in the last `val_fraction` of each
timeline. Training takes the earlier accesses, with each label kept only if its window closes before
validation starts, so no training label looks at a validation-period access.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from training.history import History, build_history
from training.labels import Examples, label_known, make_examples
from training.traces import AccessStream


@dataclasses.dataclass
class Replay:
    """A stream with its history, scored from event `score_from` on (earlier events only warm up)."""

    stream: AccessStream
    history: History
    score_from: int


def split_time(stream: AccessStream, val_fraction: float) -> float:
    """The start of the validation period of one timeline."""
    t0 = float(stream.t_ms[0])
    return t0 + (1.0 - val_fraction) * (stream.t_end_ms - t0)


def train_val_examples(streams: list[AccessStream], horizons_ms,
                       val_fraction: float) -> tuple[Examples, Examples, list[Replay]]:
    """Train examples, validation examples and, per stream, the replay scored over its validation period."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train, val, replays = [], [], []
    for s in streams:
        hist = build_history(s)
        ex = make_examples(hist, s.t_end_ms, horizons_ms)
        cut = split_time(s, val_fraction)
        tr = ex.take(np.flatnonzero(ex.t_ms < cut))
        tr.known = tr.known * label_known(tr.t_ms, cut, horizons_ms)
        train.append(tr.take(np.flatnonzero(tr.known.any(1))))
        val.append(ex.take(np.flatnonzero(ex.t_ms >= cut)))
        replays.append(Replay(s, hist, int(np.searchsorted(s.t_ms, cut, side="left"))))
    tr, va = Examples.concat(train), Examples.concat(val)
    if len(tr) == 0 or len(va) == 0:
        raise ValueError(f"the traces give {len(tr)} training and {len(va)} validation examples; they are "
                         f"too short for horizons up to {max(horizons_ms)} ms at this time scale")
    return tr, va, replays


def eval_examples(stream: AccessStream, score_from: int, horizons_ms) -> tuple[Examples, Replay]:
    """Examples of the accesses from event `score_from` on; earlier accesses are history only."""
    hist = build_history(stream)
    ex = make_examples(hist, stream.t_end_ms, horizons_ms)
    return ex.take(np.flatnonzero(ex.event >= score_from)), Replay(stream, hist, score_from)
