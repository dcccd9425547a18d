"""Live labels: pairs each block access with what happened next, for the online fine-tuner.

At an access the engine knows the block's features; the label (was it used again within h?) is known
at its next access, or, for every horizon, once the longest horizon has passed without one. The
tracker holds each block's open access until then and hands finished (features, labels) pairs to a
sink (`OnlineFineTuner.observe`). Call it from one thread (the engine's); the sink must be cheap.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Sequence

import numpy as np


class OutcomeTracker:
    """horizons_ms: the model's horizons. sink(raw [N, F], labels [N, H]) receives finished examples.
    max_open: open accesses kept; past it the oldest are dropped unlabelled (bounded memory).

    Runs on the engine thread for every tracked access, so the per-block work is a dict update, a row copy
    and two appends; labels are computed per flushed batch."""

    def __init__(self, horizons_ms: Sequence[float], sink: Callable[[np.ndarray, np.ndarray], None],
                 max_open: int = 200_000, batch: int = 64):
        self.horizons = np.asarray(horizons_ms, np.float64)
        self.sink = sink
        self.max_open = max_open
        self.batch = batch
        self._open: dict[object, tuple[float, np.ndarray]] = {}      # block -> (access ms, raw [F])
        self._order: collections.deque = collections.deque()       # (access ms, block), oldest first
        self._raw: list[np.ndarray] = []          # finished examples: features at the access [F] ...
        self._gap_ms: list[float] = []            # ... and the time to the next use (inf: none seen)

    def accessed(self, block_ids: Sequence, raw: np.ndarray, now_ms: float) -> None:
        """Blocks used at now_ms with their features raw [N, F] at this access."""
        self.expire(now_ms)
        open_, order = self._open, self._order
        raw = np.asarray(raw, np.float32)
        for i, b in enumerate(block_ids):
            prev = open_.get(b)
            if prev is not None:
                self._raw.append(prev[1])
                self._gap_ms.append(now_ms - prev[0])
            open_[b] = (now_ms, raw[i].copy())     # a copy: a view would pin the whole batch
            order.append((now_ms, b))
        while len(open_) > self.max_open:
            t, b = order.popleft()
            if b in open_ and open_[b][0] == t:
                del open_[b]
        self._flush(force=False)

    def expire(self, now_ms: float) -> None:
        """Closes accesses older than the longest horizon: not used again within any horizon."""
        longest = self.horizons[-1]
        while self._order and now_ms - self._order[0][0] > longest:
            t, b = self._order.popleft()
            cur = self._open.get(b)
            if cur is not None and cur[0] == t:
                del self._open[b]
                self._raw.append(cur[1])
                self._gap_ms.append(math.inf)
        self._flush(force=False)

    def flush(self) -> None:
        self._flush(force=True)

    def idle(self, now_ms: float) -> None:
        """No traffic: closes what has expired by now and hands over every finished example, however
        few (with no new accesses the batch would never fill)."""
        self.expire(now_ms)
        self._flush(force=True)

    def _flush(self, force: bool) -> None:
        if self._raw and (force or len(self._raw) >= self.batch):
            labels = (np.asarray(self._gap_ms)[:, None] <= self.horizons[None, :]).astype(np.float32)
            self.sink(np.stack(self._raw), labels)
            self._raw, self._gap_ms = [], []
