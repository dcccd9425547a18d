"""The engine's stats accounting: what it reports about itself (`EngineStats` snapshots for the metrics, the
cost model and benchmarks; `StepTiming`, what its latest step ran) and the running measurements they come
from (`StepRecorder`: step count, recent step costs and queue waits; `kv_tokens_written`)."""
from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING, Iterable

import numpy as np

from stratum_jax.request_usage import charge_step

if TYPE_CHECKING:      # only for annotations: this module stays importable without jax (metrics, tests)
    from stratum_jax.scheduler.base import ScheduledBatch
    from stratum_jax.sequence import Sequence
    from stratum_jax.step_work import StepWork


@dataclasses.dataclass
class EngineStats:
    queued: int
    running: int
    kv_pages_total: int           # in 8-token base pages
    kv_pages_free: int
    kv_tokens_total: int
    kv_tokens_used: int           # slots in pages that running requests own (allocated)
    kv_tokens_written: int        # of those, slots holding a token (allocated - written = fragmentation)
    prefix_cache_hits: int        # full pages served from the prefix cache
    prefix_cache_queries: int
    preemptions: int
    steps: int
    decode_step_ms: float         # median wall time per decode step (per token) over recent calls
    prefill_tokens_per_s: float   # median over recent steps that prefilled (tokens / step time)
    gpu_idle_frac: float | None = None   # share of the last second with no step on the device (gpu_idle.py)
    gpu_idle_gap_ms: float | None = None # idle gap between the previous step's results and the latest dispatch
    kv_host_tokens_total: int = 0        # host tier capacity (0: no host tier)
    kv_host_tokens_used: int = 0         # tokens of the pages it holds, kept copies included (kv/host_tier.py)
    kv_host_reused_pages: int = 0        # evicted pages that went back to the tier with their kept copy (no copy)
    kv_host_hits: int = 0                # prefix pages a request got from the host tier (also in prefix_cache_hits)
    kv_prefetched_pages: int = 0         # host-tier pages recalled ahead of their request's admission
    kv_offloaded_pages: int = 0          # pages copied HBM -> host
    kv_recalled_pages: int = 0           # pages copied host -> HBM (host hits + prefetches)
    jit_compilations: int = 0            # XLA compiles in this process since the engine was built
    jit_compilations_after_serving: int = 0   # of those, after warm-up (each one is a bug)
    hab_triggers: int = 0                # times HAB admitted by CPM (0 for FCFS)
    prefill_tokens: int = 0              # prompt tokens the engine has prefilled (cache hits excluded)
    kv_precision: str = "bf16"           # the KV precision running (--kv-precision after its fallbacks)
    kv_bytes_per_token: int = 0          # KV bytes a token slot holds over all layers (DKVC: deltas + scales)
    kv_recall_batches: int = 0           # steps that recalled host-tier pages
    kv_recall_seconds: tuple[float, ...] = ()   # host-to-device copy time of the latest such steps (<= 64)
    kv_recall_choices: int = 0           # host-tier prefix hits the recall choice sent to a copy ...
    kv_recompute_choices: int = 0        # ... and to a recompute (kv/recall_choice.py)
    # Counted work over device time, median of recent steps (step_work.py; 0 before the first timed step):
    # over the start-up read bandwidth and matmul peak they are the utilization gauges.
    step_bytes_per_s: float = 0.0
    step_flops_per_s: float = 0.0
    untimed_steps: int = 0               # steps read back with no measured device time ...
    estimated_steps: int = 0             # ... of which billed at the recent rates (request_usage.py)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    kind: str            # "decode", "prefill" or "mixed"
    seconds: float       # wall time of the step, inputs to sampled tokens on the host
    num_seqs: int
    num_tokens: int      # tokens processed (prompt tokens + decode tokens)
    prefill_tokens: int = 0


class StepRecorder:
    """The engine's running measurements, read back step by step: the step count, the latest step's
    `StepTiming`, recent step costs (medians for the scheduler, the cost model and EngineStats) and recent
    queue waits (the DMLP's queue_wait_ms feature). Engine thread only."""

    def __init__(self, window: int = 64):
        self.steps = 0
        self.prefill_tokens = 0                         # prompt tokens prefilled by steps read back, in all
        self.last_step: StepTiming | None = None       # the latest step read back, for benchmarks/metrics
        self.recent_decode_ms: collections.deque[float] = collections.deque(maxlen=window)   # per token step
        self.recent_prefill_tps: collections.deque[float] = collections.deque(maxlen=window)
        self._recent_queue_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.mean_queue_ms: float | None = None        # mean admission wait of recent requests
        self.recent_bytes_per_s: collections.deque[float] = collections.deque(maxlen=window)   # counted work
        self.recent_flops_per_s: collections.deque[float] = collections.deque(maxlen=window)   # per device s
        self.untimed_steps = 0                          # steps read back with no measured device time
        self.estimated_steps = 0                        # of those, steps charged at recent rates

    def record_timing(self, batch: ScheduledBatch, device_s: float, work: StepWork | None = None) -> None:
        """A step read back: `batch` ran on the device for `device_s` seconds (0 or less: not timed), doing
        `work` (counted, step_work.py; None: not counted)."""
        prefill_tokens = sum(batch.chunk_lens)
        self.prefill_tokens += prefill_tokens
        self.last_step = StepTiming(batch.kind, device_s, len(batch.seqs), batch.num_tokens, prefill_tokens)
        if device_s <= 0:
            # Not timed (it ran while the host was elsewhere): billed at recent rates, kept out of the medians.
            self.untimed_steps += 1
            estimate = self.estimated_step_s(batch)
            if estimate is not None:
                self.estimated_steps += 1
                charge_step(batch, estimate, estimated=True)
            return
        charge_step(batch, device_s)      # each row's share, for its request's metered bill
        if work is not None:
            self.recent_bytes_per_s.append(work.bytes_moved / device_s)
            self.recent_flops_per_s.append(work.flops / device_s)
        # Medians over recent steps: an outlier step must not skew the estimate.
        if batch.kind == "decode":
            self.recent_decode_ms.append(device_s * 1e3 / max(1, max(batch.decode_steps)))
        else:
            self.recent_prefill_tps.append(prefill_tokens / device_s)

    def record_postprocessed(self, batch: ScheduledBatch) -> None:
        """A step's results were post-processed: one more step, and the queue wait of each sequence whose
        first step it was (after the postprocessing, so its block accesses saw the waits before it)."""
        self.steps += 1
        for seq in batch.seqs:
            if seq.admit_time is not None and not seq.queue_wait_recorded:
                self._recent_queue_ms.append((seq.admit_time - seq.arrival_time) * 1e3)
                self.mean_queue_ms = statistics.fmean(self._recent_queue_ms)
                seq.queue_wait_recorded = True

    def estimated_step_s(self, batch: ScheduledBatch) -> float | None:
        """What `batch` would take at recent rates (None before a step of its kind was measured): a decode
        step, the median decode step time x its steps; a prefill or mixed step, its prompt tokens at the median
        prompt rate of recent prefill and mixed steps (whose time included their decode rows)."""
        if batch.kind == "decode":
            per_step = self.decode_ms_per_step()
            return None if per_step is None else per_step * max(1, max(batch.decode_steps)) / 1e3
        rate = self.prefill_tokens_per_s()
        return None if rate is None else sum(batch.chunk_lens) / rate

    def decode_ms_per_step(self) -> float | None:
        """Median device ms per decode step (one token per row) of recent decode steps (None before the first)."""
        return statistics.median(self.recent_decode_ms) if self.recent_decode_ms else None

    def work_rates(self) -> tuple[float, float]:
        """(bytes, FLOPs) per device second of recent steps' counted work, medians (0, 0 before the first)."""
        if not self.recent_bytes_per_s:
            return 0.0, 0.0
        return statistics.median(self.recent_bytes_per_s), statistics.median(self.recent_flops_per_s)

    def prefill_tokens_per_s(self) -> float | None:
        """Median prompt tokens per second of recent prefill and mixed steps (None before the first)."""
        return statistics.median(self.recent_prefill_tps) if self.recent_prefill_tps else None


def kv_tokens_written(running: Iterable[Sequence]) -> int:
    """Slots of the running sequences' pages that hold a token, shared (prefix) pages counted once. Vectorised:
    the server reads stats after every step, and 64 sequences at 32K context own thousands of pages."""
    starts, counts = [], []
    for seq in running:
        page_starts, ps = seq.blocks.page_starts(), seq.blocks.page_size
        starts.append(page_starts)
        counts.append(np.clip(seq.num_computed - np.arange(len(page_starts)) * ps, 0, ps))
    if not starts:
        return 0
    starts, counts = np.concatenate(starts), np.concatenate(counts)
    order = np.lexsort((-counts, starts))            # by page, the most written copy first
    starts, counts = starts[order], counts[order]
    first = np.ones(len(starts), bool)
    first[1:] = starts[1:] != starts[:-1]
    return int(counts[first].sum())
