"""The KV page pool: physical pages out of the buddy allocator, reference counts, and hash-based prefix caching.

A page is `page_size` contiguous token slots (the same slots in every layer's pool). A full page's
content is immutable, so it gets a chain hash (prefix_hash.py: its parent's hash, its page size and its
token ids) and can be shared by any later request with the same prefix and page size. When the last
owner lets go of a hashed page it stays cached (evictable) instead of freed; allocation evicts cached
pages only when the buddy tree has no block of the size asked for.

Which cached pages go is the cache policy's call (the `CachePolicy` protocol, stratum_jax/cache_policy.py;
the DMLP's is stratum_jax/dmlp/policy.py). `LruPolicy` (the default) is served by a fast path: the least
recently released page goes first, with no candidate lists built. Any other policy sees every access
(`observe_access`, in one batch per engine step: the pool queues them until `new_step` or the next
eviction decision, whichever comes first) and is asked for a batch of victims among the unowned cached
pages (`choose_victims`); the ranking it returns is used in order for up to VICTIM_TTL_MS (10 ms, the
DMLP's shortest horizon). A `DmlpPolicy` is not even asked while the least recently used candidate is
idle past its longest horizon (see `lru_beyond_ms`).

Each cached page carries a `BlockMeta` (block_meta.py): its history and its features at the last
access, which feed the policy and the --trace-out event log alike.

With a host tier (`host_tokens` > 0, kv/host_tier.py), an evicted page moves to host memory instead of
being dropped, keeping its hash and its BlockMeta; `match_prefix` finds it there, `acquire_prefix`
recalls it into a fresh HBM page, and `prefetch` recalls queued requests' pages into free HBM ahead of
their admission (these moves are host_moves.py). The pool only books them (`take_transfers`); the engine
copies the data before its next device step (kv/transfer.py).

Block events for --trace-out (created, accessed, evicted, recalled, freed) all go through `_record`.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable, Iterable, Sequence

from stratum_jax.block_info import BlockInfo
from stratum_jax.cache_policy import CachePolicy, LruPolicy
from stratum_jax.kv.block_meta import NO_REQUEST, BlockMeta, Clock, EngineClock, RequestFeatures
from stratum_jax.kv.buddy import BASE_PAGE_TOKENS, BuddyAllocator, order_for_page_size
from stratum_jax.kv.host_moves import HostTierMoves
from stratum_jax.kv.host_tier import HostPage, HostTier, PendingTransfers
from stratum_jax.kv.prefix_hash import chain_hash, iter_chain_hashes
from stratum_jax.kv.recall_choice import RecallChoice

VICTIM_BATCH = 16     # victims asked of a non-LRU policy at a time
VICTIM_TTL_MS = 10.0  # how long such a ranking is used (in order, skipping pages re-used since)


@dataclasses.dataclass(eq=False)
class Page:
    start_slot: int                 # first token slot; a multiple of page_size
    page_size: int
    ref_count: int = 0
    content_hash: bytes | None = None   # set once the page is full and registered in the prefix cache
    meta: BlockMeta | None = None       # set while the page is in the prefix cache (_by_hash)
    parent_hash: bytes | None = None    # the previous page's hash in the chain (None for the first)
    recall_source: HostPage | None = None   # set while this step's host->device copy into it is pending
    host_copy: HostPage | None = None       # the host page it was recalled from, kept as its clean copy


class PagePool(HostTierMoves):
    """Owns every page of the KV cache. Not thread-safe: the engine thread is its only user.

    policy: the cache policy (default `LruPolicy`). clock: ms on the engine's clock (default: since
    construction). `request_features(request_id) -> RequestFeatures | None` is the engine's hook for the
    request-level features of an access; without it they are missing.
    """

    def __init__(self, num_slots: int, enable_prefix_caching: bool = True, policy: CachePolicy | None = None,
                 clock: Clock | None = None, host_tokens: int = 0):
        if num_slots % (BASE_PAGE_TOKENS << 5):
            raise ValueError(f"num_slots must be a multiple of 256, got {num_slots}")
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = policy if policy is not None else LruPolicy()
        self._pool_lru = bool(self.policy.pool_lru)
        self._lru_beyond_ms = self.policy.lru_beyond_ms
        self.clock: Clock = clock if clock is not None else EngineClock()
        self.request_features: Callable[[str | None], RequestFeatures | None] | None = None
        self._buddy = BuddyAllocator(num_slots // BASE_PAGE_TOKENS)
        self._by_hash: dict[bytes, Page] = {}
        # Cached pages nobody owns, least recently released first: the eviction candidates.
        self._evictable: collections.OrderedDict[int, Page] = collections.OrderedDict()
        self._evictable_slots = 0
        # Non-LRU policies only: a heap of (access seq, start slot) over the evictable pages, stale
        # entries skipped lazily; the ranking of the current step; accesses not yet shown to the policy.
        self._by_access: list[tuple[int, int]] = []
        self._victims: collections.deque[bytes] = collections.deque()
        self._victims_ms = 0.0
        self._pending: list[BlockInfo] = []
        self._recalled_pages: list[Page] = []     # pages whose recall copy is booked but not yet run
        self._access_seq = 0
        self._request_prefix: dict[str, tuple[float, int | None, float | None]] = {}
        # The host tier (None: evicted pages are dropped) and the copies booked for the next step.
        self.host = HostTier(host_tokens, on_drop=self._host_dropped) if host_tokens and enable_prefix_caching else None
        self._transfers = PendingTransfers()
        # Recall or recompute a prefix's host pages, by measured cost (kv/recall_choice.py); the engine
        # sets it (it owns the prefill measurements). None: always recall.
        self.recall_choice: RecallChoice | None = None
        self.host_hits = 0            # prefix pages recalled from the host tier for a request
        self.prefetched = 0           # pages recalled ahead of their request's admission
        self.prefix_hits = 0          # full pages reused from the cache (HBM or host tier)
        self.prefix_queries = 0       # full prompt pages looked up
        self.evictions = 0
        # Block events for the engine's --trace-out log: (event, time ms, content hash, request id,
        # BlockInfo at that access or None). Recorded only when a consumer asks for them (record_events),
        # drained by the engine each step.
        self.record_events = False
        self.events: list[tuple[str, float, bytes, str | None, BlockInfo | None]] = []

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots obtainable right now: free buddy blocks plus evictable cached pages."""
        return self._buddy.free_base_pages * BASE_PAGE_TOKENS + self._evictable_slots

    @property
    def used_slots(self) -> int:
        return self.num_slots - self.free_slots

    @property
    def cached_pages(self) -> int:
        return len(self._by_hash)

    @property
    def host_pages(self) -> int:
        return len(self.host) if self.host is not None else 0

    @property
    def hbm_fraction(self) -> float:
        """Cached pages in HBM / cached pages in HBM and the host tier (1.0 with no host tier): the DMLP's
        KV occupancy feature."""
        hbm = len(self._by_hash)
        return hbm / max(1, hbm + self.host_pages) if self.host_pages else 1.0

    @property
    def lru_fast_path(self) -> bool:
        """True when the policy is plain LRU, served without candidates, snapshots or policy calls."""
        return self._pool_lru

    # -- allocation ---------------------------------------------------------------------------------
    def allocate(self, page_size: int) -> Page | None:
        """A fresh page with ref_count 1, or None when even evicting every cached page cannot make room."""
        order = order_for_page_size(page_size)
        start = self._buddy.alloc(order)
        while start is None and self._evictable:
            self._evict(self._next_victim())
            start = self._buddy.alloc(order)
        if start is None:
            return None
        return Page(start_slot=start * BASE_PAGE_TOKENS, page_size=page_size, ref_count=1)

    def can_admit(self, prefix: Sequence[Page | HostPage], page_size: int, new_pages: int) -> bool:
        """Whether a request fits once it takes `prefix` (match_prefix's pages) and `new_pages` fresh pages
        of `page_size`: counts slots, ignores buddy splits.

        The prefix's host-tier pages need fresh HBM pages to be recalled into. Its unowned cached pages count
        in `free_slots` now but stop counting once the request holds them, so they are not room for its new
        pages: counting them let a request whose tail did not fit be admitted, preempt itself at its first
        chunk and be admitted again the next step, over and over."""
        recalls = sum(not isinstance(p, Page) for p in prefix)
        taken_back = sum(p.page_size for p in prefix if isinstance(p, Page) and p.ref_count == 0)
        return (new_pages + recalls) * page_size <= self.free_slots - taken_back

    def release(self, page: Page) -> None:
        """Drops one reference. An unowned hashed page stays cached; an unhashed one is freed."""
        if page.ref_count <= 0:
            raise ValueError(f"page at slot {page.start_slot} released more often than acquired")
        page.ref_count -= 1
        if page.ref_count:
            return
        if page.content_hash is not None and self._by_hash.get(page.content_hash) is page:
            self._make_evictable(page)
        else:
            self._buddy.free(page.start_slot // BASE_PAGE_TOKENS)

    def _make_evictable(self, page: Page) -> None:
        self._evictable[page.start_slot] = page
        self._evictable_slots += page.page_size
        if not self._pool_lru:
            heapq.heappush(self._by_access, (page.meta.access_seq, page.start_slot))
            if len(self._by_access) > 2 * len(self._evictable) + 1024:
                self._by_access = [(p.meta.access_seq, s) for s, p in self._evictable.items()]
                heapq.heapify(self._by_access)

    def new_step(self) -> None:
        """The engine starts a step: shows the accesses since the last one to the policy, in one batch."""
        self.flush_accesses()

    def end_request(self, request_id: str) -> None:
        """A request left the engine: forget its per-request prefix features."""
        self._request_prefix.pop(request_id, None)

    # -- prefix caching -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], page_size: int, max_pages: int,
                     hashes: Sequence[bytes] | None = None) -> list[Page | HostPage]:
        """The longest run of cached full pages (at most `max_pages`) that prefixes `token_ids`: HBM pages,
        and host-tier pages (`HostPage`) where HBM has none. `hashes`: the pages' chain hashes when the
        caller already has them (`prompt_chain_hashes`), else they are computed here.

        A pure lookup: nothing is acquired or counted, so the engine can probe every page size.
        """
        if not self.enable_prefix_caching:
            return []
        chain = hashes[:max_pages] if hashes is not None else iter_chain_hashes(token_ids, page_size, max_pages)
        return self._cached_run(chain)

    def _cached_run(self, hashes: Iterable[bytes]) -> list[Page | HostPage]:
        """The pages of `hashes` in order, from HBM or else the host tier, up to the first in neither."""
        found: list[Page | HostPage] = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None and self.host is not None:
                page = self.host.get(h)
            if page is None:
                break
            found.append(page)
        return found

    def acquire_prefix(self, pages: list[Page | HostPage], queried_pages: int,
                       request_id: str | None = None) -> list[Page]:
        """Takes a reference on pages returned by match_prefix (recalling host-tier ones into new HBM pages)
        and counts the hits and queries. Returns the HBM pages of the prefix: all of them, or fewer when
        HBM has no room left for a recall (the prefix then ends before that page)."""
        self.prefix_queries += queried_pages
        for page in pages:                 # held first: recalls below may evict to make room
            if isinstance(page, Page):
                self._hold(page)
        if any(isinstance(p, HostPage) for p in pages):
            pages = self._recall_prefix(pages)
        self.prefix_hits += len(pages)
        now = self.clock()
        if request_id is not None:
            # The request's reused prefix, as the trainer's history computes it: the share of its chain
            # found cached, and the deepest hit page's uses (this one included) and idle time.
            deepest = pages[-1].meta if pages else None
            self._request_prefix[request_id] = (
                len(pages) / max(1, queried_pages),
                None if deepest is None else deepest.access_count + 1,
                None if deepest is None else now - deepest.last_access_ms)
        if pages:
            self._accessed(pages, request_id, now, "accessed")
        return pages

    def _hold(self, page: Page) -> None:
        """Takes one reference (an unowned cached page stops being evictable)."""
        if page.ref_count == 0:
            del self._evictable[page.start_slot]
            self._evictable_slots -= page.page_size
        page.ref_count += 1

    def _record(self, event: str, now: float, block_id: bytes, request_id: str | None,
                meta: BlockMeta) -> None:
        """Appends a block event for the engine's --trace-out log, when one is being recorded: the one
        place that knows the event tuple (event, time ms, content hash, request id, BlockInfo)."""
        if self.record_events:
            self.events.append((event, now, block_id, request_id, self._info_of(meta)))

    def _info_of(self, meta: BlockMeta) -> BlockInfo:
        if meta.info is None:
            meta.info = meta.snapshot(self._request_context(None))
        return meta.info

    def register_full_page(self, page: Page, parent_hash: bytes | None, token_ids: Sequence[int],
                           depth: int = 0, request_id: str | None = None,
                           context: RequestFeatures | None = None) -> bytes:
        """Marks a page whose `page_size` tokens are now written as shareable; returns its hash.

        A new cached page counts as an access (its creation). context: `access_context(request_id)` when
        the caller registers several of the request's pages at once (it is the same for all of them)."""
        h = chain_hash(parent_hash, page.page_size, token_ids)
        page.content_hash = h
        page.parent_hash = parent_hash
        if self.enable_prefix_caching and h not in self._by_hash:
            if self.host is not None and h in self.host:
                # Recomputed rather than recalled (recall_choice, or no HBM room at the time): the new HBM
                # page supersedes the host copy, so a hash lives in one tier only.
                self.host.discard(h)
            self._by_hash[h] = page
            now = self.clock()
            page.meta = BlockMeta(block_id=h, depth=depth, created_ms=now)
            parent = self._by_hash.get(parent_hash) if parent_hash is not None else None
            if parent is not None:
                parent.meta.fan_out += 1
            self._accessed((page,), request_id, now, "created", context)
        return h

    def access_context(self, request_id: str | None) -> RequestFeatures | None:
        """The request's features that accesses snapshot (None when nothing snapshots them: the LRU pool
        without an event log). Building them per page was most of registering a request's pages with the DMLP
        policy (benchmarks/dmlp_host_cost.py under cProfile)."""
        return self._request_context(request_id) if not self._pool_lru or self.record_events else None

    def flush_accesses(self) -> None:
        """Shows the accesses recorded since the last flush to the policy, in one batch."""
        if self._pending:
            batch, self._pending = self._pending, []
            self.policy.observe_access(batch)

    def block_info(self, page: Page | HostPage) -> BlockInfo | None:
        """The page's features at its last access (None for a page outside the prefix cache and the host
        tier)."""
        m = page.meta
        if isinstance(page, HostPage):
            return self._info_of(m) if self.host is not None and self.host.get(page.content_hash) is page else None
        if m is None or self._by_hash.get(page.content_hash) is not page:
            return None
        return self._info_of(m)

    def _request_context(self, request_id: str | None) -> RequestFeatures:
        req = None
        if self.request_features is not None and request_id is not None:
            req = self.request_features(request_id)
        req = req or NO_REQUEST
        prefix = self._request_prefix.get(request_id) if request_id is not None else None
        if prefix is not None:
            req = dataclasses.replace(req, prefix_hit_frac=prefix[0], prefix_uses=prefix[1],
                                      prefix_gap_ms=prefix[2])
        return req

    def _accessed(self, pages, request_id: str | None, now: float, event: str,
                  context: RequestFeatures | None = None) -> None:
        """Updates the metadata of pages a request just used; snapshots their features (with `context`, or
        the request's as of now) when the policy or the event log wants them (never for LRU without
        --trace-out)."""
        want = not self._pool_lru or self.record_events
        req = (context if context is not None else self._request_context(request_id)) if want else None
        for page in pages:
            m = page.meta
            self._access_seq += 1
            m.touch(now, self._access_seq, request_id)
            if want:
                m.info = m.snapshot(req)
                if not self._pool_lru:
                    self._pending.append(m.info)
                self._record(event, now, m.block_id, request_id, m)
            else:
                m.info = None

    # -- eviction -----------------------------------------------------------------------------------
    def _next_victim(self) -> Page:
        """The next page to evict; called only while some page is evictable."""
        if self._pool_lru:
            return next(iter(self._evictable.values()))
        now = self.clock()
        if now - self._victims_ms > VICTIM_TTL_MS:
            self._victims.clear()
        page = self._next_ranked()
        if page is None and self._lru_beyond_ms is not None:
            oldest = self._oldest_evictable()
            if oldest is not None and now - oldest.meta.last_access_ms > self._lru_beyond_ms:
                page = oldest
        if page is None:
            self.flush_accesses()
            candidates = [self.block_info(p) for p in self._evictable.values()]
            # evicting=0: the ranking is a batch the pool may use only in part; the residency estimate is
            # fed each eviction actually made (note_evictions below).
            self._victims.extend(self.policy.choose_victims(
                candidates, min(len(candidates), VICTIM_BATCH), now, evicting=0))
            self._victims_ms = now
            page = self._next_ranked() or next(iter(self._evictable.values()))   # none chosen: LRU
        self.policy.note_evictions(1, now, len(self._evictable))
        return page

    def _next_ranked(self) -> Page | None:
        """The next page of the current ranking that is still evictable (skipping ones re-used since)."""
        while self._victims:
            page = self._by_hash.get(self._victims.popleft())
            if page is not None and self._evictable.get(page.start_slot) is page:
                return page
        return None

    def _oldest_evictable(self) -> Page | None:
        """The evictable page with the oldest last access (heap top, stale entries dropped)."""
        heap = self._by_access
        while heap:
            seq, slot = heap[0]
            page = self._evictable.get(slot)
            if page is not None and page.meta.access_seq == seq:
                return page
            heapq.heappop(heap)
        return None

    def _evict(self, page: Page) -> None:
        del self._evictable[page.start_slot]
        self._evictable_slots -= page.page_size
        del self._by_hash[page.content_hash]
        if self.host is not None:
            self._offload(page)
        else:
            self._record("freed", self.clock(), page.content_hash, None, page.meta)
            if not self._pool_lru:
                self.policy.forget((page.content_hash,))
        page.recall_source = None
        page.host_copy = None
        page.parent_hash = None
        page.content_hash = None
        page.meta = None
        self._buddy.free(page.start_slot // BASE_PAGE_TOKENS)
        self.evictions += 1

    def check_invariants(self) -> None:
        self._buddy.check_invariants()
        for page in self._evictable.values():
            assert page.ref_count == 0 and self._by_hash.get(page.content_hash) is page
        assert self._evictable_slots == sum(p.page_size for p in self._evictable.values())
        assert all(p.meta is not None and p.meta.block_id == h for h, p in self._by_hash.items())
        if self.host is not None:
            assert self.host.tokens == sum(p.page_size for p in self.host.pages()) <= self.host.capacity_tokens
            assert not any(p.content_hash in self._by_hash for p in self.host.pages())
            assert self.host.tokens + self.host.kept_tokens <= self.host.capacity_tokens
            assert self.host.kept_tokens == sum(p.page_size for p in self.host.kept_pages())
            assert all(hp.kept and self._by_hash[hp.content_hash].host_copy is hp for hp in self.host.kept_pages())
