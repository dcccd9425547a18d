"""What the page pool knows about each cached (hashed) page, for the cache policy and the block event log.

A `BlockMeta` lives on its page from registration in the prefix cache until the page leaves the cache.
It holds the block's history (creation, last and previous access, access count, depth, sharers,
fan-out) and, at each access, a `BlockInfo` snapshot: the block's features at that access, with the
request-level features of the request that used it (`RequestFeatures`). Nothing changes between
accesses except the time, so the snapshot is built once per access and reused as an eviction
candidate, a DMLP input and a --trace-out record.

All times are ms on one clock, `EngineClock` (ms since the engine started; tests inject their own).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from stratum_jax.block_info import BlockInfo

MAX_TRACKED_SHARERS = 256   # distinct request ids remembered per block; past it every new user counts


class EngineClock:
    """ms since construction, from time.monotonic. Callable: `clock() -> float`."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def __call__(self) -> float:
        return (time.monotonic() - self._t0) * 1e3


Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class RequestFeatures:
    """Features of the request that uses a block, at the moment it uses it (the engine fills them).

    attn_var5: the variance of the request's attention scores over its last 5 decoded tokens; None
    until the engine measures it (the hook: `block_events.BlockEventFeed.request_features`). gpu_idle_frac: the device's
    idle share of the last second (stratum_jax/gpu_idle.py); None before the engine's first step.
    kv_hbm_frac: HBM blocks / all blocks; 1.0 while there is no host tier.
    prefix_*: the request's reused prefix at admission (see `training/history.py::_request_prefix`);
    the pool fills them in, the engine leaves them None.
    """

    gen_frac: float | None = None
    input_tokens: int | None = None
    max_tokens: int | None = None
    queue_wait_ms: float | None = None
    prompt_pages: int | None = None          # full prompt pages at the request's page size (blocks_after)
    kv_hbm_frac: float | None = 1.0
    attn_var5: float | None = None
    gpu_idle_frac: float | None = None
    prefix_hit_frac: float | None = None
    prefix_uses: int | None = None
    prefix_gap_ms: float | None = None


NO_REQUEST = RequestFeatures()


@dataclasses.dataclass(eq=False, slots=True)
class BlockMeta:
    block_id: bytes                 # the page's content (chain) hash
    depth: int                      # position in the prefix chain, 0 = the first page of a prompt
    created_ms: float
    fill: float = 1.0               # registered pages are full
    last_access_ms: float = 0.0
    prev_access_ms: float | None = None
    access_count: int = 0
    access_seq: int = 0             # global order of the last access (ties of equal times)
    sharer_count: int = 0
    sharers: set = dataclasses.field(default_factory=set)
    fan_out: int = 0                # distinct child pages registered under this one
    info: BlockInfo | None = None   # features at the last access (None while nobody asked for them)

    def touch(self, now_ms: float, seq: int, request_id) -> None:
        """Records one access by request_id at now_ms."""
        if self.access_count:
            self.prev_access_ms = self.last_access_ms
        self.last_access_ms = now_ms
        self.access_count += 1
        self.access_seq = seq
        if request_id not in self.sharers:
            if len(self.sharers) < MAX_TRACKED_SHARERS:
                self.sharers.add(request_id)
            self.sharer_count += 1

    def snapshot(self, req: RequestFeatures) -> BlockInfo:
        """The block's features at its last access, as a policy candidate (so not needed by a running
        request: a candidate is an unowned page by construction)."""
        t = self.last_access_ms
        blocks_after = None if req.prompt_pages is None else max(0, req.prompt_pages - self.depth - 1)
        return BlockInfo(
            block_id=self.block_id, last_access_ms=t, access_count=self.access_count, depth=self.depth,
            recency_ms=None if self.prev_access_ms is None else t - self.prev_access_ms,
            age_ms=t - self.created_ms, blocks_after=blocks_after, fill=self.fill,
            sharers=self.sharer_count, fan_out=self.fan_out, prefix_hit_frac=req.prefix_hit_frac,
            prefix_uses=req.prefix_uses, prefix_gap_ms=req.prefix_gap_ms, input_tokens=req.input_tokens,
            max_tokens=req.max_tokens, gen_frac=req.gen_frac, attn_var5=req.attn_var5,
            kv_hbm_frac=req.kv_hbm_frac, queue_wait_ms=req.queue_wait_ms, gpu_idle_frac=req.gpu_idle_frac,
            needed_by_running=False)


def features_of(info: BlockInfo, names) -> dict:
    """{feature name: value or None} of a snapshot, for the --trace-out log."""
    return {name: getattr(info, name) for name in names}
