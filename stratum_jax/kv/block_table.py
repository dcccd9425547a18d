"""One sequence's view of the KV cache: its pages in order (its block table), at one page size."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from stratum_jax.kv.page_pool import Page, PagePool


class BlockTable:
    """The pages of one sequence. Token t lives at slot `pages[t // page_size].start_slot + t % page_size`."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.pages: list[Page] = []
        # pages[i].start_slot as int32, kept beside pages for the hot path: the runner copies every row's
        # table into the step's [rows, width] array each step, and from a Python list that conversion
        # alone costs ~5 ms per step at 64 rows x 768 pages (a numpy row copies in ~0.2 ms).
        self._starts = np.zeros(16, np.int32)
        self._num_starts = 0
        self._hashes: list[bytes] = []       # chain hashes of the leading full pages registered so far

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def adopt_prefix(self, pages: list[Page]) -> None:
        """Starts the table with cached prefix pages (already acquired from the pool)."""
        assert not self.pages
        self.pages = list(pages)
        self._starts = np.asarray([p.start_slot for p in pages] or [0], np.int32)
        self._num_starts = len(pages)
        self._hashes = [p.content_hash for p in pages]

    def pages_needed(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def ensure_capacity(self, num_tokens: int) -> bool:
        """Allocates pages until `num_tokens` fit. On failure keeps what it got and returns False."""
        while self.capacity < num_tokens:
            page = self.pool.allocate(self.page_size)
            if page is None:
                return False
            self.pages.append(page)
            if self._num_starts == len(self._starts):
                self._starts = np.concatenate([self._starts, np.zeros_like(self._starts)])
            self._starts[self._num_starts] = page.start_slot
            self._num_starts += 1
        return True

    def has_unregistered_full_pages(self, num_written: int) -> bool:
        return num_written // self.page_size > len(self._hashes)

    def register_full_pages(self, token_ids: Sequence[int], num_written: int, request_id: str | None = None) -> None:
        """Registers every page whose tokens are all written (< num_written) in the prefix cache."""
        full = num_written // self.page_size
        context = self.pool.access_context(request_id) if len(self._hashes) < full else None
        while len(self._hashes) < full:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            chunk = token_ids[i * self.page_size:(i + 1) * self.page_size]
            self._hashes.append(self.pool.register_full_page(self.pages[i], parent, chunk, i, request_id, context))

    def release(self) -> None:
        for page in self.pages:
            self.pool.release(page)
        self.pages = []
        self._num_starts = 0
        self._hashes = []

    def slots(self, start: int, count: int) -> np.ndarray:
        """Cache slots of positions [start, start + count): [count] int32 (within capacity)."""
        ps = self.page_size
        if count == 1:
            return np.asarray([self._starts[start // ps] + start % ps], np.int32)
        positions = np.arange(start, start + count, dtype=np.int32)
        return self._starts[positions // ps] + positions % ps

    def page_starts(self) -> np.ndarray:
        """First slot of each page, in order: [num_pages] int32 (the sequence's row of the block table).
        A view: do not mutate."""
        return self._starts[:self._num_starts]
