"""The server's Prometheus endpoint during a replay (benchmarks/serving.py): parsing a text exposition, the counters,
gauges and histograms it reads, and the poller that samples them every --poll-s."""
from __future__ import annotations

import asyncio
import collections
import time
import urllib.request

import numpy as np

from benchmarks.serving_stats import series_summary


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """sample name -> [(labels, value)] of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list] = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def counter_total(samples: dict, name: str) -> float | None:
    """The sum over labels of a sample, or None when the server does not export it."""
    return sum(v for _, v in samples[name]) if name in samples else None


def gauge(samples: dict, name: str) -> float | None:
    return samples[name][0][1] if name in samples else None


def histogram(samples: dict, name: str) -> dict | None:
    """A histogram summed over its label sets (the stacks)."""
    if f"{name}_bucket" not in samples:
        return None
    buckets: dict[str, float] = collections.defaultdict(float)
    for labels, v in samples[f"{name}_bucket"]:
        buckets[labels["le"]] += v
    return {"buckets": dict(buckets),
            "sum": counter_total(samples, f"{name}_sum"), "count": counter_total(samples, f"{name}_count")}


async def scrape(url: str | None) -> dict:
    if url is None:
        return {}

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    return parse_metrics(await asyncio.to_thread(get))


class Poller:
    """Samples gauges from /metrics every period_s while the replay runs."""

    NAMES = ("stratum_gpu_idle_fraction", "stratum_queue_length", "stratum_running_requests",
             "stratum_prefill_tokens_total", "stratum_hbm_bandwidth_utilization", "stratum_gpu_compute_utilization")
    GAUGES = {"stratum_gpu_idle_fraction", "stratum_hbm_bandwidth_utilization", "stratum_gpu_compute_utilization"}

    def __init__(self, url: str | None, period_s: float) -> None:
        self.url, self.period_s = url, period_s
        self.samples: list[list] = []        # [t_s, *NAMES values]
        self.errors = 0
        self._task = None

    async def _run(self, t0: float) -> None:
        while True:
            try:
                s = await scrape(self.url)
                # The idle fraction and the utilizations are the first stack's (the Stratum stack's: its engine
                # measures its own steps); the queue, running and prefill figures are summed over the stacks.
                self.samples.append([round(time.perf_counter() - t0, 3)] + [
                    gauge(s, n) if n in self.GAUGES else counter_total(s, n) for n in self.NAMES])
            except (OSError, ValueError):      # a missed sample is counted, not fatal
                self.errors += 1
            await asyncio.sleep(self.period_s)

    def start(self, t0: float) -> None:
        if self.url is not None:
            self._task = asyncio.create_task(self._run(t0))

    async def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        cols = list(zip(*self.samples)) if self.samples else [[] for _ in range(len(self.NAMES) + 1)]
        return {"fields": ["t_s", *self.NAMES], "rows": self.samples, "scrape_errors": self.errors,
                **{n.removeprefix("stratum_"): series_summary(cols[i + 1]) for i, n in enumerate(self.NAMES)},
                **while_queued(self.samples), **utilization_while_running(self.samples)}


def utilization_while_running(rows: list[list]) -> dict:
    """The step utilization gauges (issue #18) over the Poller rows taken while requests ran (column 3 > 0):
    the gauges are medians of the engine's latest steps, so an idle server keeps showing its last ones."""
    busy = [r for r in rows if r[3]]
    return {f"{name}_while_running": series_summary([r[col] for r in busy])
            for name, col in (("hbm_bandwidth_utilization", 5), ("gpu_compute_utilization", 6))}


def while_queued(rows: list[list]) -> dict:
    """The saturation figures of issue #10 from Poller rows [t_s, idle fraction, queue length, running,
    prefill tokens total]: over the sample intervals that start and end with requests queued, the mean
    device idle fraction and the prefill throughput (prefilled tokens / seconds). None without such
    intervals (or without the counter: an older server)."""
    idle, seconds, tokens = [], 0.0, 0.0
    for a, b in zip(rows, rows[1:]):
        if not (a[2] and b[2]):                           # queue empty (or not read) at either end
            continue
        if b[1] is not None:
            idle.append(b[1])
        if a[4] is not None and b[4] is not None:
            seconds += b[0] - a[0]
            tokens += b[4] - a[4]
    return {"queued_seconds": round(seconds, 3),
            "gpu_idle_fraction_while_queued": round(float(np.mean(idle)), 4) if idle else None,
            "prefill_tokens_per_s_while_queued": round(tokens / seconds, 1) if seconds > 0 else None}
