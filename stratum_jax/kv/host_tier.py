"""The host-memory tier of the KV cache: full prefix pages evicted from HBM, kept to be recalled.

When HBM needs room, the page pool evicts cached pages (ones no request holds). With a host tier, an
evicted page's KV moves here instead of being dropped; a later request whose prompt hashes to it gets
it copied back (a *recall*: one host->device copy instead of recomputing the prefill), and queued
requests' pages can be recalled before they are admitted (*prefetch*, ordered by the cache policy).

Page contents are immutable (a page's chain hash names its tokens and its whole prefix), so a page's
KV can be moved and shared by reference. The copies themselves are batched by the engine once per step
(`kv/transfer.py`): the pool only records what must move, in `PendingTransfers`.

Data of one page: a jax array in host memory (jax's `pinned_host` memory kind on a GPU, kv/transfer.py)
[page_size, layers, 2 (k, v), kv_heads, head_dim] in the model's dtype (slot-major: one contiguous block
per page, see kv/transfer.py), or uint8 rows for a DKVC cache. Arrays are immutable, so a page that is
the same as another (`same_as`) shares its array, and a page leaving the tier just lets go of it (jax's
host allocator reuses the memory).

*Kept copies.* A recalled page's host data is not let go: HBM holds the page again, and its host copy
stays (`HostTier.keep`) as a clean copy of it, so when the page is evicted again it goes back to the tier
with that data and no device -> host copy at all (a conversation's prefix recalled, then evicted again
while the user types, is moved once, not twice). Kept copies count against the tier's capacity and are the
first to go when room is needed (HBM still has their pages, so dropping one costs only a later copy).
A hash is in the tier (`pages`) or in HBM, never both; a kept copy is not a tier page (it is not a prefix
hit, HBM is).

Why the host tier is LRU whatever the HBM policy: its job is to hold what HBM could not, and a block
reaches it only after the HBM policy judged it the least likely to be reused soon; past that, recency
is the signal that is left (the DMLP knows nothing beyond its longest horizon, 500 ms by default).
"""
from __future__ import annotations

import collections
import dataclasses

import jax

from stratum_jax.kv.block_meta import BlockMeta


@dataclasses.dataclass(eq=False)
class HostPage:
    """A page held in host memory. `data` is None until the step's device->host copy fills it: then the
    page's KV is either at `src_slot` of the device cache as it was when this step's scheduling began,
    or the same as another host page's (`same_as`: the page was recalled and evicted again in one pass)."""

    content_hash: bytes
    parent_hash: bytes | None
    page_size: int
    meta: BlockMeta
    data: jax.Array | None = None     # in host memory (kv/transfer.py)
    src_slot: int | None = None
    same_as: "HostPage | None" = None
    dropped: bool = False               # left the tier: its data is no longer wanted
    kept: bool = False                  # its data stays as the clean copy of the HBM page recalled from it

    def resolved(self) -> jax.Array:
        """The page's KV [page_size, ...] in host memory; its copy must have been started."""
        if self.data is None and self.same_as is not None:
            self.data = self.same_as.resolved()  # immutable: shared, not copied
            self.same_as = None
        if self.data is None:
            raise RuntimeError(f"host page {self.content_hash.hex()} has no data yet: the engine must run "
                               "the step's device->host copies first")
        return self.data


@dataclasses.dataclass
class PendingTransfers:
    """What moves before the next device step, in this order: `offloads` (device -> host, reading the
    cache as it was when scheduling began) then `recalls` (host -> device, into freshly allocated pages)."""

    offloads: list[HostPage] = dataclasses.field(default_factory=list)
    # Pages evicted again right after their recall in this pass (`same_as` a recall source): they take
    # the source's data before the recall lets go of it.
    aliases: list[HostPage] = dataclasses.field(default_factory=list)
    # start slot of the new HBM page -> its source. A recalled page evicted again before the copy ran
    # loses its entry, so the slots of the entries left never overlap.
    recalls: dict[int, HostPage] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.recalls)


class HostTier:
    """Pages by content hash, least recently stored or used first; at most `capacity_tokens` tokens.

    `on_drop(page)` is called for each page pushed out by a newer one (it leaves every tier)."""

    def __init__(self, capacity_tokens: int, on_drop=None):
        if capacity_tokens <= 0:
            raise ValueError(f"host tier capacity must be > 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.on_drop = on_drop
        self._pages: collections.OrderedDict[bytes, HostPage] = collections.OrderedDict()
        self.tokens = 0
        self.stored = 0        # pages moved in from HBM
        self.recalled = 0      # pages moved back to HBM
        self.dropped = 0       # pages pushed out for lack of room
        # Kept copies (module docstring): content hash -> the host page recalled into HBM whose data stays,
        # oldest first; their tokens count against the capacity.
        self._kept: collections.OrderedDict[bytes, HostPage] = collections.OrderedDict()
        self.kept_tokens = 0
        self.kept_dropped = 0  # kept copies let go to make room
        self.reused = 0        # evicted pages that went back with their kept copy (no device -> host copy)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._pages

    def get(self, content_hash: bytes) -> HostPage | None:
        return self._pages.get(content_hash)

    def put(self, page: HostPage) -> None:
        """Stores a page evicted from HBM (the newest), dropping the oldest ones while over capacity."""
        if page.page_size > self.capacity_tokens:
            self._drop(page)
            return
        self._insert(page)
        self.stored += 1

    def _insert(self, page: HostPage) -> None:
        old = self._pages.pop(page.content_hash, None)
        if old is not None:
            self.tokens -= old.page_size
        self._pages[page.content_hash] = page
        self.tokens += page.page_size
        while self.tokens + self.kept_tokens > self.capacity_tokens and self._kept:
            self._let_go(self._kept.popitem(last=False)[1])      # a kept copy first: HBM has its page
            self.kept_dropped += 1
        while self.tokens > self.capacity_tokens:
            _, dropped = self._pages.popitem(last=False)
            self.tokens -= dropped.page_size
            self._drop(dropped)

    def _drop(self, page: HostPage) -> None:
        """A page leaves every tier: its host memory is let go (a page in the tier is nobody's `same_as`
        source: those are pages taken for a recall)."""
        page.dropped = True
        page.data = None
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop(page)

    def take(self, content_hash: bytes) -> HostPage:
        """Removes a page to recall it into HBM."""
        page = self._pages.pop(content_hash)
        self.tokens -= page.page_size
        self.recalled += 1
        return page

    def discard(self, content_hash: bytes) -> None:
        """Forgets a page that HBM holds again (recomputed, not recalled): one copy per hash across tiers."""
        page = self._pages.pop(content_hash)
        self.tokens -= page.page_size
        page.data = None

    def keep(self, page: HostPage) -> bool:
        """A page taken for a recall into HBM keeps its data as the HBM page's clean copy (module docstring),
        if the tier has room for it without letting anything go; returns whether it was kept.

        Called when the pass's copies are handed to the engine (`take_transfers`), so the kept copies that a
        later `put` lets go for room have had their recall copies run. Letting one go here could drop the
        data of a recall this very pass still has to copy."""
        if self.tokens + self.kept_tokens + page.page_size > self.capacity_tokens:
            return False
        page.kept = True
        self._kept[page.content_hash] = page
        self.kept_tokens += page.page_size
        return True

    def release_kept(self, page: HostPage) -> jax.Array | None:
        """The HBM page of a kept copy is leaving HBM (or was evicted again before its recall copy ran):
        the copy stops being kept. Returns its data if it was still kept (the caller hands it on), else None
        (it was let go for room)."""
        if not page.kept:
            return None
        del self._kept[page.content_hash]
        self.kept_tokens -= page.page_size
        page.kept = False
        return page.data

    def _let_go(self, page: HostPage) -> None:
        self.kept_tokens -= page.page_size
        page.kept = False
        page.data = None

    def kept_pages(self):
        return self._kept.values()

    def give_back(self, page: HostPage) -> None:
        """Returns a page taken for a recall that could not get HBM room (as the newest: a request just
        asked for it)."""
        self.recalled -= 1
        self._insert(page)

    def pages(self):
        return self._pages.values()
