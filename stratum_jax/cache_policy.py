"""The cache policy's contract with the runtime, and its baseline.

`CachePolicy` is everything the page pool, the scheduler and the engine ask of a cache policy: which
cached blocks to evict, which host-tier blocks to recall first, which page size a request gets, and
what to do with each block access and while the engine is idle. `LruPolicy` is the baseline;
`stratum_jax/dmlp/policy.py::DmlpPolicy` answers from the reuse predictor. kv/ and dmlp/ both depend on
this module (and on block_info.py), never on each other.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from stratum_jax.block_info import BlockInfo
from stratum_jax.page_size import DefaultPageSizeRule, PageSizeHints


class CachePolicy(Protocol):
    """What the runtime calls on a cache policy. Times are ms on the engine's clock.

    pool_lru: True lets the page pool evict in its own least-recently-released order, with no
    candidates built and no policy calls (plain LRU's fast path).
    lru_beyond_ms: a candidate idle longer than this would be ranked last anyway, so the pool may evict
    the least recently used one without asking (then it calls `note_evictions`); None: always ask.
    idle_tick_ms: how often an idle engine should call `tick`; None: never.
    """

    pool_lru: bool
    lru_beyond_ms: float | None
    idle_tick_ms: float | None

    def observe_access(self, infos: Sequence[BlockInfo]) -> object:
        """Blocks requests just used (created or reused), one batch per engine step."""

    def choose_victims(self, candidates: Sequence[BlockInfo], n: int, now_ms: float,
                       evicting: int | None = None) -> list:
        """Block ids of up to n unowned candidates to evict, first to evict first; `evicting`: how many
        the caller will surely evict now (0: it takes them one at a time, reporting each with
        `note_evictions`)."""

    def note_evictions(self, n: int, now_ms: float, cached: int) -> None:
        """n evictions made without a `choose_victims` call counting them; `cached` blocks remain."""

    def forget(self, block_ids: Iterable) -> None:
        """Blocks that left every tier."""

    def prefetch_order(self, candidates: Sequence[BlockInfo], now_ms: float) -> list:
        """Block ids of host-tier candidates, the first to recall first."""

    def page_size_for(self, hints: PageSizeHints, prefix_blocks: Sequence[BlockInfo] = (),
                      now_ms: float = 0.0) -> int:
        """The page size of a new request (`prefix_blocks`: its cached prefix at the default size)."""

    def tick(self, now_ms: float) -> None:
        """The engine is idle (called every `idle_tick_ms`)."""


class LruPolicy:
    """The baseline: evict the least recently used, prefetch the most recently used first.

    `pool_lru`: the page pool evicts in its own least-recently-released order without building
    candidates or calling `choose_victims` (the engine's behaviour before policies existed, and the
    cheapest path). `choose_victims` serves callers that hold `BlockInfo`s (the simulator, tests).
    """

    pool_lru = True
    lru_beyond_ms = None    # never asked for victims at all (pool_lru)
    idle_tick_ms = None     # no work to do while the engine is idle

    def observe_access(self, infos: Sequence[BlockInfo]) -> None:
        return None

    def tick(self, now_ms: float) -> None:
        return None

    def note_evictions(self, n: int, now_ms: float, cached: int) -> None:
        return None

    def forget(self, block_ids) -> None:
        return None

    def choose_victims(self, candidates: Sequence[BlockInfo], n: int, now_ms: float, evicting=None) -> list:
        free = [b for b in candidates if not b.needed_by_running]
        return [b.block_id for b in sorted(free, key=lambda b: b.last_access_ms)[:max(n, 0)]]

    def prefetch_order(self, candidates: Sequence[BlockInfo], now_ms: float) -> list:
        return [b.block_id for b in sorted(candidates, key=lambda b: -b.last_access_ms)]

    def page_size_for(self, hints: PageSizeHints, prefix_blocks: Sequence[BlockInfo] = (),
                      now_ms: float = 0.0) -> int:
        return DefaultPageSizeRule()(hints)
