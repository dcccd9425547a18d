"""Live labels: pairs each block access with what happened next, for the online fine-tuner.

At an access the engine knows the block's features; the label (was it used again within h?) is known
at its next access, or, for every horizon, once the longest horizon has passed without one. The
tracker holds each block's open access until then and hands finished (features, labels) pairs to a
sink (`OnlineFineTuner.observe`). Call it from one thread (the engine's); the sink must be cheap.
"""
from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np


class OutcomeTracker:
    """horizons_ms: the model's horizons. sink(raw [N, F], labels [N, H]) receives finished examples.
    max_open: open accesses kept; past it the oldest are dropped unlabelled (bounded memory)."""

    def __init__(self, horizons_ms: Sequence[float], sink: Callable[[np.ndarray, np.ndarray], None],
                 max_open: int = 200_000, batch: int = 64):
        self.horizons = np.asarray(horizons_ms, np.float64)
        self.sink = sink
        self.max_open = max_open
        self.batch = batch
        self._open: dict[object, tuple[float, np.ndarray]] = {}      # block -> (access ms, raw [F])
        self._order: collections.deque = collections.deque()       # (access ms, block), oldest first
        self._raw: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []

    def accessed(self, block_ids: Sequence, raw: np.ndarray, now_ms: float) -> None:
        """Blocks used at now_ms with their features raw [N, F] at this access."""
        self.expire(now_ms)
        for b, row in zip(block_ids, raw):
            prev = self._open.get(b)
            if prev is not None:
                self._finish(prev[1], (now_ms - prev[0] <= self.horizons).astype(np.float32))
            self._open[b] = (now_ms, np.asarray(row, np.float32))
            self._order.append((now_ms, b))
        while len(self._open) > self.max_open:
            t, b = self._order.popleft()
            if b in self._open and self._open[b][0] == t:
                del self._open[b]
        self._flush(force=False)

    def expire(self, now_ms: float) -> None:
        """Closes accesses older than the longest horizon: not used again within any horizon."""
        zeros = np.zeros(len(self.horizons), np.float32)
        while self._order and now_ms - self._order[0][0] > self.horizons[-1]:
            t, b = self._order.popleft()
            cur = self._open.get(b)
            if cur is not None and cur[0] == t:
                del self._open[b]
                self._finish(cur[1], zeros)
        self._flush(force=False)

    def flush(self) -> None:
        self._flush(force=True)

    def idle(self, now_ms: float) -> None:
        """No traffic: closes what has expired by now and hands over every finished example, however
        few (with no new accesses the batch would never fill)."""
        self.expire(now_ms)
        self._flush(force=True)

    def _finish(self, raw: np.ndarray, labels: np.ndarray) -> None:
        self._raw.append(raw)
        self._labels.append(labels)

    def _flush(self, force: bool) -> None:
        if self._raw and (force or len(self._raw) >= self.batch):
            self.sink(np.stack(self._raw), np.stack(self._labels))
            self._raw, self._labels = [], []
