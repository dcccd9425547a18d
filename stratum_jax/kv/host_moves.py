"""The page pool's moves between HBM and the host tier: recalls of matched prefixes, prefetches of queued
requests' pages, offloads of evicted pages, and the copies they book for the engine (kv/transfer.py).

`HostTierMoves` is a half of `PagePool` (page_pool.py), kept apart because it is one idea: it works on
the pool's own state (`host`, `_by_hash`, `_transfers`, `_recalled_pages`, ...) and its allocation,
hold/release and event recording, and is never used on its own.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Sequence

from stratum_jax.kv.host_tier import HostPage, PendingTransfers

if TYPE_CHECKING:
    from stratum_jax.kv.page_pool import Page


class HostTierMoves:
    def _recall_prefix(self, pages: list[Page | HostPage]) -> list[Page]:
        """Recalls the host-tier pages of a matched prefix whose HBM pages are held. Returns the prefix
        as HBM pages, each held once, cut before the first page that found no room (the held pages past
        the cut are let go, the host pages go back to the tier). With a `recall_choice`, a prefix whose
        recall would take longer than recomputing it (measured rates, kv/recall_choice.py) is cut at its
        first host page the same way."""
        first = next(i for i, p in enumerate(pages) if isinstance(p, HostPage))
        recompute = self.recall_choice is not None and not self.recall_choice.should_recall(
            sum(p.page_size for p in pages if isinstance(p, HostPage)), sum(p.page_size for p in pages[first:]))
        taken = [self.host.take(p.content_hash) if isinstance(p, HostPage) else None for p in pages]
        out: list[Page] = []
        for i, (page, hp) in enumerate(zip(pages, taken)):
            if hp is not None:
                page = None if recompute else self._recall(hp, ref_count=1)
                if page is None:           # no room (or recomputing is cheaper): the prefix ends here
                    for rest, rest_hp in zip(pages[i:], taken[i:]):
                        if rest_hp is not None:
                            self.host.give_back(rest_hp)
                        else:
                            self.release(rest)
                    break
                self.host_hits += 1
            out.append(page)
        return out

    def _recall(self, hp: HostPage, ref_count: int) -> Page | None:
        """A new HBM page for a host-tier page taken out of the tier, with its copy booked; None when
        there is no room even after evicting every unowned cached page."""
        page = self.allocate(hp.page_size)
        if page is None:
            return None
        page.ref_count = ref_count
        page.content_hash, page.parent_hash, page.meta = hp.content_hash, hp.parent_hash, hp.meta
        page.recall_source = hp
        self._by_hash[hp.content_hash] = page
        self._transfers.recalls[page.start_slot] = hp
        self._recalled_pages.append(page)
        self._record("recalled", self.clock(), hp.content_hash, None, hp.meta)
        return page

    def _offload(self, page: Page) -> None:
        """Books the move of an evicted HBM page to the host tier. Its KV is in the device cache as it was
        when this step's scheduling began, unless the page was itself recalled during this scheduling
        (then it is that recall's data)."""
        kept = self.host.release_kept(page.host_copy) if page.host_copy is not None else None
        hp = HostPage(page.content_hash, page.parent_hash, page.page_size, page.meta,
                      src_slot=None if page.recall_source is not None or kept is not None else page.start_slot,
                      same_as=page.recall_source, data=kept)
        if page.recall_source is not None:     # its own recall copy is moot now
            del self._transfers.recalls[page.start_slot]
            self._transfers.aliases.append(hp)
        elif kept is not None:                 # its host copy was kept since its recall: nothing to copy
            self.host.reused += 1
        if hp.src_slot is not None:
            self._transfers.offloads.append(hp)
        self._record("evicted", self.clock(), page.content_hash, None, page.meta)
        self.host.put(hp)

    def host_candidates(self, hashes_by_size: dict[int, Sequence[bytes]]) -> tuple[list[HostPage], list[Page]]:
        """A queued prompt's cached prefix: its host-tier pages (prefetch candidates) and its HBM pages
        (which a prefetch must not evict). hashes_by_size: page size -> the prompt's full-page chain
        hashes under that size (`prompt_chain_hashes`). A prefix is usable only from its start, so each
        chain is walked until a page is in neither tier."""
        if self.host is None or not len(self.host):
            return [], []
        host, hbm = [], []
        for hashes in hashes_by_size.values():
            for page in self._cached_run(hashes):
                (host if isinstance(page, HostPage) else hbm).append(page)
        return host, hbm

    def prefetch(self, candidates: Sequence[HostPage], max_pages: int, keep: Sequence[Page] = ()) -> int:
        """Recalls up to `max_pages` host-tier pages of queued requests into HBM, in the policy's prefetch
        order, a page only after its parent (a prefix is only usable from its start). Room comes from free
        slots first, then from evicting cached pages the policy ranks lowest, never `keep` (the queued
        requests' HBM prefix pages) nor a page prefetched here: a queued request's page is about to be
        used, which an idle cached page is not known to be. The pages stay cached and unowned until a
        request takes them. Returns how many were recalled."""
        if self.host is None or max_pages <= 0:
            return 0
        unique = {hp.content_hash: hp for hp in candidates if hp.content_hash in self.host}
        if not unique:
            return 0
        now = self.clock()
        order = self.policy.prefetch_order([self._info_of(hp.meta) for hp in unique.values()], now)
        held = list({id(p): p for p in keep if p.content_hash is not None and self._by_hash.get(p.content_hash) is p}.values())
        for p in held:
            self._hold(p)
        waiting: dict[bytes, list[HostPage]] = collections.defaultdict(list)   # parent -> deferred
        recalled: list[Page] = []
        full = False
        for h in order:
            stack = [unique[h]]
            while stack and not full and len(recalled) < max_pages:
                hp = stack.pop()
                if hp.content_hash not in self.host:
                    continue
                if hp.parent_hash is not None and hp.parent_hash not in self._by_hash:
                    waiting[hp.parent_hash].append(hp)
                    continue
                taken = self.host.take(hp.content_hash)
                page = self._recall(taken, ref_count=1)      # held until the end: not evicted by the next
                if page is None:                             # no room left that may be taken
                    self.host.give_back(taken)
                    full = True
                    break
                recalled.append(page)
                stack.extend(reversed(waiting.pop(hp.content_hash, [])))
            if full or len(recalled) >= max_pages:
                break
        for p in recalled + held:
            self.release(p)
        self.prefetched += len(recalled)
        return len(recalled)

    def take_transfers(self) -> PendingTransfers:
        """The copies booked since the last call (the engine runs them before its next device step)."""
        out, self._transfers = self._transfers, PendingTransfers()
        for page in self._recalled_pages:
            if page.recall_source is not None and self.host.keep(page.recall_source):
                page.host_copy = page.recall_source    # still in HBM: its source stays as its clean copy
            page.recall_source = None
        self._recalled_pages = []
        return out

    def _host_dropped(self, hp: HostPage) -> None:
        """A page left the host tier for lack of room: it leaves every tier."""
        self._record("freed", self.clock(), hp.content_hash, None, hp.meta)
        if not self._pool_lru:
            self.policy.forget((hp.content_hash,))
