"""A buddy allocator over 8-token base pages.

Why buddy and not one pool per size class: a request's page size (8..256 tokens) is chosen per request, so
the demand per class moves with the traffic. Separate pools would have to be sized in advance and strand
memory in the classes nobody uses; a buddy tree splits and re-merges the same memory on demand. Every
block of order k covers 2^k base pages and starts at a multiple of 2^k, so a page of P tokens is P
contiguous, P-aligned token slots: the decode kernel reads it as one contiguous copy per head.
"""
from __future__ import annotations

import heapq

BASE_PAGE_TOKENS = 8
MAX_ORDER = 5                       # 8 * 2^5 = 256 tokens


def order_for_page_size(page_size: int) -> int:
    order = (page_size // BASE_PAGE_TOKENS).bit_length() - 1
    if not 0 <= order <= MAX_ORDER or page_size != BASE_PAGE_TOKENS << order:
        raise ValueError(f"page size must be 8 * 2^k tokens with k in [0, {MAX_ORDER}], got {page_size}")
    return order


class BuddyAllocator:
    """Allocates aligned blocks of 2^order base pages out of `num_base_pages` (a multiple of 2^MAX_ORDER).

    Free blocks sit in one min-heap per order (lowest address first, so allocation is deterministic and
    packs low), with a set per order for O(1) membership during merges; heap entries whose block left the
    set are skipped lazily.
    """

    def __init__(self, num_base_pages: int):
        top = 1 << MAX_ORDER
        if num_base_pages <= 0 or num_base_pages % top:
            raise ValueError(f"num_base_pages must be a positive multiple of {top}, got {num_base_pages}")
        self.num_base_pages = num_base_pages
        self._free: list[set[int]] = [set() for _ in range(MAX_ORDER + 1)]
        self._heaps: list[list[int]] = [[] for _ in range(MAX_ORDER + 1)]
        self._allocated: dict[int, int] = {}          # start base page -> order
        for start in range(0, num_base_pages, top):
            self._push(start, MAX_ORDER)

    # -- public -------------------------------------------------------------------------------------
    @property
    def free_base_pages(self) -> int:
        return sum(len(s) << k for k, s in enumerate(self._free))

    def largest_free_order(self) -> int:
        for k in range(MAX_ORDER, -1, -1):
            if self._free[k]:
                return k
        return -1

    def alloc(self, order: int) -> int | None:
        """Returns the start base page of a free block of 2^order base pages, or None when none fits."""
        k = order
        while k <= MAX_ORDER and not self._free[k]:
            k += 1
        if k > MAX_ORDER:
            return None
        start = self._pop(k)
        while k > order:                     # split, keeping the low half, freeing the high buddy
            k -= 1
            self._push(start + (1 << k), k)
        self._allocated[start] = order
        return start

    def free(self, start: int) -> None:
        order = self._allocated.pop(start, None)
        if order is None:
            raise ValueError(f"base page {start} is not the start of an allocated block (double free?)")
        while order < MAX_ORDER:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)       # merge: the heap entry goes stale and is skipped
            start = min(start, buddy)
            order += 1
        self._push(start, order)

    def check_invariants(self) -> None:
        """Every base page is in exactly one free or allocated block (used by the tests)."""
        owner = [0] * self.num_base_pages
        blocks = [(s, k) for k, ss in enumerate(self._free) for s in ss] + list(self._allocated.items())
        for start, order in blocks:
            assert start % (1 << order) == 0, f"block {start} of order {order} is misaligned"
            for p in range(start, start + (1 << order)):
                owner[p] += 1
        assert all(c == 1 for c in owner), "base pages are double-booked or lost"

    # -- internals ----------------------------------------------------------------------------------
    def _push(self, start: int, order: int) -> None:
        self._free[order].add(start)
        heapq.heappush(self._heaps[order], start)

    def _pop(self, order: int) -> int:
        heap, live = self._heaps[order], self._free[order]
        while True:
            start = heapq.heappop(heap)
            if start in live:
                live.discard(start)
                return start
