"""The per-request page-size rule. Replaceable: the reuse predictor (DMLP) will choose page sizes later."""
from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Protocol

from stratum_jax.config import PAGE_SIZE_CLASSES


@dataclasses.dataclass(frozen=True)
class PageSizeHints:
    expected_tokens: int                    # prompt + max_tokens
    shared_prefix_tokens: int = 0           # tokens a prefix-cache lookup would reuse at some page size
    # The request's attention-score variance over its last tokens relative to recent requests' (1.0 = the
    # running median; see VarianceScale); None when unknown.
    attention_score_variance: float | None = None


class PageSizeRule(Protocol):
    def __call__(self, hints: PageSizeHints) -> int: ...


@dataclasses.dataclass(frozen=True)
class DefaultPageSizeRule:
    """Large pages for long, unshared contexts and high attention-score variance; small pages for short
    or shared prefixes and low variance (the design's rule).

    Why: a page is the unit of reuse and of waste. A short or shared context wastes little with small
    pages and shares at a fine grain; a long private context wants big pages so the kernel moves KV in
    few large copies. High score variance means attention concentrates on few positions, which large
    contiguous pages stream more cheaply than many small ones.
    """

    tokens_per_page: int = 16     # aim for about this many pages per request
    high_variance: float = 1.5    # relative variance (1.0 = the median of recent requests) that counts as high

    def __call__(self, hints: PageSizeHints) -> int:
        target = max(hints.expected_tokens // self.tokens_per_page, PAGE_SIZE_CLASSES[0])
        if hints.shared_prefix_tokens:
            # A shared prefix is only reusable at a page size that divides it into full pages.
            target = min(target, 32)
        if hints.attention_score_variance is not None and hints.attention_score_variance >= self.high_variance:
            target *= 2
        size = PAGE_SIZE_CLASSES[0]
        for s in PAGE_SIZE_CLASSES:
            if s <= target:
                size = s
        return size


@dataclasses.dataclass(frozen=True)
class FixedPageSize:
    page_size: int

    def __call__(self, hints: PageSizeHints) -> int:
        return self.page_size


class VarianceScale:
    """Makes attention-score variances relative: a raw variance depends on the model (its head size, its
    training), so "high" is judged against the median of the last `window` requests' values. Engine
    thread only."""

    def __init__(self, window: int = 256):
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._sorted: list[float] = []

    def observe(self, value: float) -> None:
        """A finished request's variance (Sequence.attn_var5)."""
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(value)
        bisect.insort(self._sorted, value)

    def relative(self, value: float | None) -> float | None:
        """value / the running median; None when either is unknown (no value, or no request seen yet)."""
        if value is None or not self._sorted:
            return None
        median = self._sorted[len(self._sorted) // 2]
        return value / median if median > 0 else None
