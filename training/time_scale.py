"""Choosing the replay time scale from the trace, and spotting labels that carry no information.

A trace's pace (seconds between a conversation's turns) and the model's horizons (ms) are unrelated,
so at a fixed scale the labels can be almost all 0 (the trace is slow) or almost all 1: the model then
learns the majority answer and ranks blocks no better than LRU. The scale is picked so that the
headline horizon's positive rate is informative, without losing many of its labels to the end of the
trace (a window [t, t + h] that runs past the end is an unknown label).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys

import numpy as np

from training.dataset import split_time
from training.history import build_history
from training.labels import label_known, reuse_labels
from training.traces import AccessStream

log = logging.getLogger(__name__)

HEADLINE_HORIZON_MS = 500.0
RATE_BAND = (0.2, 0.8)          # the headline horizon's positive rate the chosen scale aims for
FLAT_BAND = (0.02, 0.98)        # every horizon outside this: the labels are flat
MIN_VAL_KNOWN = 0.5             # share of validation accesses whose headline label must stay known
SAMPLE_EVENTS = 500_000         # per stream: the scale is chosen on the start of each timeline
# Candidates 1e-3 .. 1e8, ten per decade (steps of 26%), at two significant digits so they read well.
CANDIDATES = tuple(float(f"{10.0 ** (k / 10):.2g}") for k in range(-30, 81))


@dataclasses.dataclass(frozen=True)
class ScaleChoice:
    scale: float
    horizon_ms: float
    positive_rate: float     # the headline horizon's, on the sample's training labels, at `scale`
    val_known: float         # share of the sample's validation accesses with a known headline label
    in_band: bool            # positive_rate within RATE_BAND


def headline_target(horizons_ms) -> float:
    """The horizon the scale is tuned for: 500 ms when trained for, else the longest below it (or the
    shortest), so a custom horizon list still gets a scale."""
    hs = sorted(float(h) for h in horizons_ms)
    if not hs:
        raise ValueError("no horizons given")
    below = [h for h in hs if h <= HEADLINE_HORIZON_MS]
    return below[-1] if below else hs[0]


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One stream's accesses at scale 1, [E]: times, next access of the block (+inf if none), and
    whether each falls in the training part of the timeline; `cut`/`t_end` in trace ms."""

    t: np.ndarray
    next_ms: np.ndarray
    cut: float
    t_end: float


def _head(stream: AccessStream, n: int) -> AccessStream:
    """The first n accesses of a stream, its observed window ending at the n-th."""
    if stream.num_events <= n:
        return stream
    cols = {f.name: getattr(stream, f.name)[:n] for f in dataclasses.fields(AccessStream)
            if isinstance(getattr(stream, f.name), np.ndarray)}
    return dataclasses.replace(stream, **cols, t_end_ms=float(stream.t_ms[n - 1]), file_starts=[0])


def _sample(stream: AccessStream, val_fraction: float) -> _Sample:
    head = _head(stream, SAMPLE_EVENTS)
    hist = build_history(head)
    return _Sample(hist.cols["t_ms"], hist.next_ms, split_time(head, val_fraction), head.t_end_ms)


def rates_at(samples: list[_Sample], horizon_ms: float, scale: float) -> tuple[float, float]:
    """With trace time divided by `scale`: (the positive rate of the horizon's training labels, the
    share of validation accesses whose label for it is known). The labels are those `train_val_examples`
    makes from the streams read at that scale: a training label is known if its window closes before
    the validation period, a validation label if it closes inside the trace."""
    pos = known = val_known = val_total = 0.0
    for s in samples:
        t, nxt = s.t / scale, s.next_ms / scale
        train = s.t < s.cut
        k = label_known(t[train], s.cut / scale, [horizon_ms])[:, 0]
        lab = reuse_labels(nxt[train], t[train], [horizon_ms])[:, 0]
        pos += float((lab * k).sum())
        known += float(k.sum())
        val_known += float(label_known(t[~train], s.t_end / scale, [horizon_ms]).sum())
        val_total += float((~train).sum())
    return (pos / known if known else math.nan), (val_known / val_total if val_total else 0.0)


def choose_time_scale(streams: list[AccessStream], horizons_ms, val_fraction: float) -> ScaleChoice:
    """The scale for `streams` (read at scale 1): the CANDIDATE whose headline horizon's training
    positive rate is closest to 0.5 among those that keep at least MIN_VAL_KNOWN of the validation
    accesses' headline labels (a long window runs past the end of the trace), so validation still
    scores the headline horizon. If none lands in RATE_BAND, the closest anyway, with in_band False."""
    h = headline_target(horizons_ms)
    samples = [_sample(s, val_fraction) for s in streams]
    best = None
    for scale in CANDIDATES:
        rate, val_known = rates_at(samples, h, scale)
        if val_known < MIN_VAL_KNOWN or math.isnan(rate):
            break          # larger scales only lose more labels to the end of the trace
        if best is None or abs(rate - 0.5) < abs(best.positive_rate - 0.5):
            ok = RATE_BAND[0] <= rate <= RATE_BAND[1]
            best = ScaleChoice(scale, h, rate, val_known, ok)
    if best is None:
        raise ValueError(f"the traces are too short for a {h:g} ms horizon at any time scale >= "
                         f"{CANDIDATES[0]:g}; pass --time-scale")
    return best


def flat_labels(positive_rate) -> bool:
    """True when every horizon's positive rate [H] is below 2% or above 98%: the labels then say
    almost nothing and a model trained on them ranks blocks like LRU."""
    r = np.asarray(positive_rate, np.float64)
    return bool(len(r)) and bool(np.all((r < FLAT_BAND[0]) | (r > FLAT_BAND[1])))


def warn_loudly(msg: str) -> None:
    """A warning that a log filter cannot hide: logged at WARNING and written to stderr."""
    log.warning(msg)
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)
