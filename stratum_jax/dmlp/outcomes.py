"""Live labels: pairs each block access with what happened next, for the online fine-tuner.

At an access the engine knows the block's features; the label at horizon h (was it used again within h?)
is decided at the block's next access if that comes within h (then it is 1), or once h has passed without
one (then it is 0). The tracker hands each horizon's label over as soon as it is decided, as rows
(raw [F], labels [H], known [H]) whose `known` marks the horizons decided by that row; an access's
undecided (censored) horizons are in none of its rows yet. So every (access, horizon) pair reaches the
learner exactly once, and a short horizon is learnt from as soon as it has passed.

Why per horizon: handing an access over only when all of its horizons are decided (its next use, or the
longest horizon passing) delivers reused accesses early and unreused ones a full longest horizon late. On a
run shorter than that horizon the learner then sees only reused accesses (issue #15: 100% positive at
500 ms against a true 41%; `benchmarks/dmlp_online_labels.py`). A horizon decided at its own deadline
delivers a negative at t + h; its positives still come earlier (at the reuse), so the share of positives at
horizon h is biased upwards only during the first h ms of a run, and the learner must not judge a horizon
whose holdout has one class (`learner.Learner.round`).

Call it from one thread (the engine's); the sink must be cheap.
"""
from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np


class OutcomeTracker:
    """horizons_ms: the model's horizons, strictly increasing. sink(raw [N, F], labels [N, H], known [N, H])
    receives decided labels (known = 1 where a row decides that horizon). max_open: open accesses kept; past
    it the oldest are dropped with their undecided horizons (bounded memory).
    hold_reuse: hand a reuse's labels over at each horizon's own deadline (t + h) instead of at the reuse,
    so that when a label reaches the learner does not depend on its value and no horizon's positives run
    ahead of its negatives (at the cost of learning of a reuse up to h later).

    Runs on the engine thread for every tracked access, so the per-block work is a dict update, a row copy
    and H appends; labels are computed per flushed batch."""

    def __init__(self, horizons_ms: Sequence[float], sink: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
                 max_open: int = 200_000, batch: int = 64, hold_reuse: bool = False):
        self.horizons = np.asarray(horizons_ms, np.float64)
        if self.horizons.ndim != 1 or not len(self.horizons) or not np.all(np.diff(self.horizons) > 0):
            raise ValueError(f"horizons_ms must be a non-empty strictly increasing sequence, got {list(horizons_ms)}")
        self.sink = sink
        self.max_open = max_open
        self.batch = batch
        self.hold_reuse = hold_reuse
        # block -> its open (latest) access, an entry [access ms, raw [F], horizons decided so far, gap to
        # the next use (inf: none yet), block]. Horizons are increasing, so those decided are a prefix.
        self._open: dict[object, list] = {}
        # One queue of entries per horizon, oldest first: horizon j of an entry is handed over when the
        # entry reaches the front of queue j more than h_j after its access (0, or 1 for a held reuse).
        self._due = [collections.deque() for _ in self.horizons]
        self._raw: list[np.ndarray] = []          # decided rows: features at the access [F] ...
        self._gap_ms: list[float] = []            # ... the time to the next use (inf: none within the row's horizons) ...
        self._first: list[int] = []               # ... and the row's horizons: first..last index, inclusive ...
        self._last: list[int] = []

    def accessed(self, block_ids: Sequence, raw: np.ndarray, now_ms: float) -> None:
        """Blocks used at now_ms with their features raw [N, F] at this access."""
        self.expire(now_ms)
        open_, due = self._open, self._due
        raw = np.asarray(raw, np.float32)
        n_h = len(self.horizons)
        for i, b in enumerate(block_ids):
            prev = open_.get(b)
            if prev is not None:       # reuse: every horizon still undecided (>= the gap, after expire) is 1
                prev[3] = now_ms - prev[0]
                if not self.hold_reuse:
                    self._emit(prev[1], prev[3], prev[2], n_h - 1)
                    prev[2] = n_h
            entry = [now_ms, raw[i].copy(), 0, float("inf"), b]     # a copy: a view would pin the whole batch
            open_[b] = entry
            for q in due:
                q.append(entry)
        while len(open_) > self.max_open:
            entry = due[-1].popleft()
            entry[2] = n_h                        # its undecided horizons are dropped
            if open_.get(entry[4]) is entry:
                del open_[entry[4]]
        self._flush(force=False)

    def expire(self, now_ms: float) -> None:
        """Hands over every horizon h of an access older than h not handed over yet: 0 if the block was not
        used again within h, 1 for a reuse held to its deadline (`hold_reuse`)."""
        open_, last = self._open, len(self.horizons) - 1
        for j, (h, q) in enumerate(zip(self.horizons.tolist(), self._due)):
            while q and now_ms - q[0][0] > h:
                entry = q.popleft()
                if entry[2] == j:             # else decided already (a reuse) or dropped
                    self._emit(entry[1], entry[3], j, j)
                    entry[2] = j + 1
                if j == last and open_.get(entry[4]) is entry:
                    del open_[entry[4]]
        self._flush(force=False)

    def _emit(self, raw: np.ndarray, gap_ms: float, first: int, last: int) -> None:
        self._raw.append(raw)
        self._gap_ms.append(gap_ms)
        self._first.append(first)
        self._last.append(last)

    def flush(self) -> None:
        self._flush(force=True)

    def idle(self, now_ms: float) -> None:
        """No traffic: decides what has expired by now and hands over every decided row, however few (with
        no new accesses the batch would never fill)."""
        self.expire(now_ms)
        self._flush(force=True)

    def _flush(self, force: bool) -> None:
        if self._raw and (force or len(self._raw) >= self.batch):
            labels = (np.asarray(self._gap_ms)[:, None] <= self.horizons[None, :]).astype(np.float32)
            j = np.arange(len(self.horizons))[None, :]
            known = ((j >= np.asarray(self._first)[:, None]) & (j <= np.asarray(self._last)[:, None]))
            self.sink(np.stack(self._raw), labels, known.astype(np.float32))
            self._raw, self._gap_ms, self._first, self._last = [], [], [], []
