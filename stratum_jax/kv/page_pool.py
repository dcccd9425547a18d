"""The KV page pool: physical pages out of the buddy allocator, reference counts, and hash-based prefix caching.

A page is `page_size` contiguous token slots (the same slots in every layer's pool). A full page's content
is immutable, so it gets a chain hash (its parent's hash, its page size and its token ids) and can be shared
by any later request with the same prefix and page size. When the last owner lets go of a hashed page it
stays cached (evictable) instead of freed; allocation evicts cached pages, least recently used first, only
when the buddy tree has no block of the size asked for.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from stratum_jax.kv.buddy import BASE_PAGE_TOKENS, BuddyAllocator, order_for_page_size


@dataclasses.dataclass(eq=False)
class Page:
    start_slot: int                 # first token slot; a multiple of page_size
    page_size: int
    ref_count: int = 0
    content_hash: bytes | None = None   # set once the page is full and registered in the prefix cache


def chain_hash(parent: bytes | None, page_size: int, token_ids: Sequence[int]) -> bytes:
    """Hash of a full page given its parent's hash: equal hashes mean equal prefixes (and page size)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(page_size.to_bytes(2, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.digest()


class PagePool:
    """Owns every page of the KV cache. Not thread-safe: the engine thread is its only user."""

    def __init__(self, num_slots: int, enable_prefix_caching: bool = True):
        if num_slots % (BASE_PAGE_TOKENS << 5):
            raise ValueError(f"num_slots must be a multiple of 256, got {num_slots}")
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self._buddy = BuddyAllocator(num_slots // BASE_PAGE_TOKENS)
        self._by_hash: dict[bytes, Page] = {}
        # Cached pages nobody owns, oldest first: the eviction candidates.
        self._evictable: collections.OrderedDict[int, Page] = collections.OrderedDict()
        self.prefix_hits = 0          # full pages reused from the cache
        self.prefix_queries = 0       # full prompt pages looked up
        self.evictions = 0
        # Block events for the engine's --trace-out log: (event, content hash, depth, request id).
        # Recorded only when a consumer asks for them (record_events), drained by the engine each step.
        self.record_events = False
        self.events: list[tuple[str, bytes, int, str | None]] = []

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots obtainable right now: free buddy blocks plus evictable cached pages."""
        return self._buddy.free_base_pages * BASE_PAGE_TOKENS + sum(
            p.page_size for p in self._evictable.values())

    @property
    def used_slots(self) -> int:
        return self.num_slots - self.free_slots

    @property
    def cached_pages(self) -> int:
        return len(self._by_hash)

    # -- allocation ---------------------------------------------------------------------------------
    def allocate(self, page_size: int) -> Page | None:
        """A fresh page with ref_count 1, or None when even evicting every cached page cannot make room."""
        order = order_for_page_size(page_size)
        start = self._buddy.alloc(order)
        while start is None and self._evictable:
            self._evict_one()
            start = self._buddy.alloc(order)
        if start is None:
            return None
        return Page(start_slot=start * BASE_PAGE_TOKENS, page_size=page_size, ref_count=1)

    def can_allocate(self, page_size: int, count: int) -> bool:
        """Conservative check that `count` pages of `page_size` fit (counts slots, ignores buddy splits)."""
        return count * page_size <= self.free_slots

    def release(self, page: Page) -> None:
        """Drops one reference. An unowned hashed page stays cached; an unhashed one is freed."""
        if page.ref_count <= 0:
            raise ValueError(f"page at slot {page.start_slot} released more often than acquired")
        page.ref_count -= 1
        if page.ref_count:
            return
        if page.content_hash is not None and self._by_hash.get(page.content_hash) is page:
            self._evictable[page.start_slot] = page
        else:
            self._buddy.free(page.start_slot // BASE_PAGE_TOKENS)

    # -- prefix caching -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], page_size: int, max_pages: int) -> list[Page]:
        """The longest run of cached full pages (at most `max_pages`) that prefixes `token_ids`.

        A pure lookup: nothing is acquired or counted, so the engine can probe every page size.
        """
        if not self.enable_prefix_caching:
            return []
        found: list[Page] = []
        parent = None
        for i in range(max_pages):
            parent = chain_hash(parent, page_size, token_ids[i * page_size:(i + 1) * page_size])
            page = self._by_hash.get(parent)
            if page is None:
                break
            found.append(page)
        return found

    def acquire_prefix(self, pages: list[Page], queried_pages: int, request_id: str | None = None) -> None:
        """Takes a reference on pages returned by match_prefix and counts the hits and queries."""
        self.prefix_queries += queried_pages
        self.prefix_hits += len(pages)
        for depth, page in enumerate(pages):
            if page.ref_count == 0:
                del self._evictable[page.start_slot]
            page.ref_count += 1
            if self.record_events:
                self.events.append(("accessed", page.content_hash, depth, request_id))

    def register_full_page(self, page: Page, parent_hash: bytes | None, token_ids: Sequence[int],
                           depth: int = 0, request_id: str | None = None) -> bytes:
        """Marks a page whose `page_size` tokens are now written as shareable; returns its hash."""
        h = chain_hash(parent_hash, page.page_size, token_ids)
        page.content_hash = h
        if self.enable_prefix_caching and h not in self._by_hash:
            self._by_hash[h] = page
            if self.record_events:
                self.events.append(("created", h, depth, request_id))
        return h

    def _evict_one(self) -> None:
        _, page = self._evictable.popitem(last=False)
        del self._by_hash[page.content_hash]
        if self.record_events:
            self.events.append(("freed", page.content_hash, -1, None))
        page.content_hash = None
        self._buddy.free(page.start_slot // BASE_PAGE_TOKENS)
        self.evictions += 1

    def check_invariants(self) -> None:
        self._buddy.check_invariants()
        for page in self._evictable.values():
            assert page.ref_count == 0 and self._by_hash.get(page.content_hash) is page
