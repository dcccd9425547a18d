"""How idle the device is: the DMLP's `gpu_idle_frac` feature and the `stratum_gpu_idle_*` metrics.

A step keeps the device busy from when it can start (its dispatch, or the end of the step queued before
it) until it ends; everything else (post-processing, scheduling, packing the next step, or waiting for
requests, whenever no step is queued) is device idle time. This is the design's "wall gap between a
step's completion and the next dispatch" (DESIGN.md, HAB). `GpuIdleMeter` keeps the busy intervals of a
sliding window and answers the idle fraction of that window, and the last gap; `DeviceTimeline` works out
the intervals from what the host can see of steps it dispatches without waiting for them.
"""
from __future__ import annotations

import collections
from typing import Protocol


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


class DeviceStep(Protocol):
    """A dispatched step, as the timeline sees it (model_runner.InFlightStep)."""

    def is_ready(self) -> bool:
        """True once the device has finished the step."""


class DeviceTimeline:
    """When the device ran each dispatched step, as far as the host can tell, fed to a GpuIdleMeter.

    The host sees a step end only when it looks: when it waits for the results (the wait returns at the
    end), or when it polls `is_ready` between its own pieces of work (`watch`). A step found finished by a
    poll ended after the last time the host saw it running: the timeline takes that time as its end, the
    latest it can be, so idle time is never under-counted (it is over-counted by at most the time between
    two polls). Times are ms on one clock. Engine thread only.
    """

    def __init__(self, meter: GpuIdleMeter):
        self.meter = meter
        self._starts: dict[int, float] = {}   # id(step) -> when the device can start it
        self._free_ms: float | None = None    # when the device finished the last step read back
        self._running_at: float | None = None   # the last time the host saw the oldest step running
        self._seen_done: set[int] = set()

    @property
    def last_end_ms(self) -> float | None:
        return self._free_ms

    def dispatched(self, step: DeviceStep, at_ms: float) -> None:
        start = at_ms if self._free_ms is None else max(at_ms, self._free_ms)
        self._starts[id(step)] = start

    def watch(self, step: DeviceStep | None, now_ms: float) -> None:
        """A poll of the oldest unread step: running now, or finished (since the last poll that saw it run)."""
        if step is None or id(step) in self._seen_done:
            return
        if step.is_ready():
            self._seen_done.add(id(step))
        else:
            self._running_at = now_ms

    def idle_since_ms(self, step: DeviceStep | None) -> float | None:
        """Since when the device has had nothing to do (None: it is busy with `step`, the oldest unread)."""
        if step is None:
            return self._free_ms
        if id(step) not in self._seen_done:
            return None
        return max(self._running_at or 0.0, self._starts[id(step)])

    def read(self, step: DeviceStep, waited_until_ms: float, was_done: bool) -> tuple[float, float]:
        """The host read `step`'s results; waited_until_ms: when the wait returned; was_done: whether the
        step had finished before the host started waiting. Records the busy interval and returns it."""
        start = self._starts.pop(id(step))
        self._seen_done.discard(id(step))
        end = waited_until_ms
        if was_done and self._running_at is not None:
            end = max(start, self._running_at)
        elif was_done:
            end = start          # never seen running: it ran while the host was busy; count no busy time
        self._running_at = None
        self._free_ms = end = max(start, end)
        for other, queued_at in self._starts.items():     # steps queued behind it start when it ends
            self._starts[other] = max(queued_at, end)
        self.meter.step(start, end)
        return start, end
