"""What the engine reports about itself: `EngineStats` snapshots (metrics, the cost model, benchmarks) and
`StepTiming`, what its latest step ran."""
from __future__ import annotations

import dataclasses


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
    kv_host_tokens_used: int = 0         # tokens of the pages it holds
    kv_host_hits: int = 0                # prefix pages a request got from the host tier (also in prefix_cache_hits)
    kv_prefetched_pages: int = 0         # host-tier pages recalled ahead of their request's admission
    kv_offloaded_pages: int = 0          # pages copied HBM -> host
    kv_recalled_pages: int = 0           # pages copied host -> HBM (host hits + prefetches)
    jit_compilations: int = 0            # XLA compiles in this process since the engine was built
    jit_compilations_after_serving: int = 0   # of those, after warm-up (each one is a bug)
    hab_triggers: int = 0                # times HAB admitted by CPM (0 for FCFS)
    kv_precision: str = "bf16"           # the KV precision running (--kv-precision after its fallbacks)
    kv_bytes_per_token: int = 0          # KV bytes a token slot holds over all layers (DKVC: deltas + scales)
    kv_recall_batches: int = 0           # steps that recalled host-tier pages
    kv_recall_seconds: tuple[float, ...] = ()   # host-to-device copy time of the latest such steps (<= 64)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    kind: str            # "decode", "prefill" or "mixed"
    seconds: float       # wall time of the step, inputs to sampled tokens on the host
    num_seqs: int
    num_tokens: int      # tokens processed (prompt tokens + decode tokens)
    prefill_tokens: int = 0
