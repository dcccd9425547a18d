"""How idle the device is: the DMLP's `gpu_idle_frac` feature and the `stratum_gpu_idle_*` metrics.

The engine blocks on each step's results, so a step keeps the device busy from its dispatch until its
results are on the host; everything between two steps (sampling post-processing, streaming, scheduling,
or waiting for requests) is device idle time. This is the design's "wall gap between a step's completion
and the next dispatch" (DESIGN.md, HAB). The meter keeps the busy intervals of a sliding window and
answers the idle fraction of that window; it also keeps the last gap.
"""
from __future__ import annotations

import collections


class GpuIdleMeter:
    """window_ms: the span the idle fraction covers. Times are ms on one clock. Engine thread only."""

    def __init__(self, window_ms: float = 1000.0):
        self.window_ms = window_ms
        self._busy: collections.deque[tuple[float, float]] = collections.deque()   # (start, end), oldest first
        self._busy_ms = 0.0            # total length of the intervals in _busy (kept so reads are O(1))
        self._first_ms: float | None = None
        self.last_gap_ms: float | None = None     # idle gap before the latest step (None before the second)

    def step(self, start_ms: float, end_ms: float) -> None:
        """A device step ran from `start_ms` (dispatch) to `end_ms` (results on the host)."""
        if self._first_ms is None:
            self._first_ms = start_ms
        elif self._busy:
            self.last_gap_ms = max(0.0, start_ms - self._busy[-1][1])
        self._busy.append((start_ms, end_ms))
        self._busy_ms += end_ms - start_ms
        self._trim(end_ms)

    def idle_fraction(self, now_ms: float) -> float | None:
        """Fraction of the last `window_ms` (or of the time since the first step, if shorter) with no step
        on the device; None before the first step."""
        if self._first_ms is None:
            return None
        self._trim(now_ms)
        since = max(now_ms - self.window_ms, self._first_ms)
        span = now_ms - since
        if span <= 0:
            return 0.0
        busy = self._busy_ms
        if self._busy:       # intervals are in time order: only the oldest can start before the window,
            start, end = self._busy[0]                 # and only the newest can end after `now_ms`
            busy -= max(0.0, min(end, since) - start)
            start, end = self._busy[-1]
            busy -= max(0.0, end - max(start, now_ms))
        return min(1.0, max(0.0, 1.0 - busy / span))

    def _trim(self, now_ms: float) -> None:
        while self._busy and self._busy[0][1] < now_ms - self.window_ms:
            start, end = self._busy.popleft()
            self._busy_ms -= end - start
