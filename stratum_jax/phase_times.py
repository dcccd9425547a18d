"""Host wall time by named phase, for breakdowns such as a host-tier recall's (benchmarks/host_tier.py).

A `PhaseTimes` sums `time.perf_counter` spans per name; the engine owns one (`Engine.phases`) and hands it
to the parts it times (scheduler admission, KV transfers). A name with a dot ("transfers.upload") is a
part of the phase before its dot and is counted in it too, so only dot-free names add up to the time the
spans cover. A span costs about a microsecond, so it stays on. Not thread-safe: the engine thread is its
one writer.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Iterator


class PhaseTimes:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Adds the wall time of the `with` body to `name` (also when the body raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Adds a span measured elsewhere (e.g. a time a caller already has)."""
        if not name or name.startswith(".") or name.endswith("."):
            raise ValueError(f"phase name must be non-empty with no leading or trailing dot, got {name!r}")
        self.seconds[name] += seconds
        self.calls[name] += 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Seconds per phase since `before` (an earlier `snapshot`), phases with no time since left out."""
        return {k: v - before.get(k, 0.0) for k, v in self.seconds.items() if v - before.get(k, 0.0) > 0}


def top_level_total(seconds: dict[str, float]) -> float:
    """The time covered by a breakdown's phases: its dot-free names only (a dotted one is a part of one)."""
    return sum(v for k, v in seconds.items() if "." not in k)
