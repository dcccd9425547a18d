"""The host-memory tier of the KV cache: full prefix pages evicted from HBM, kept to be recalled.

When HBM needs room, the page pool evicts cached pages (ones no request holds). With a host tier, an
evicted page's KV moves here instead of being dropped; a later request whose prompt hashes to it gets
it copied back (a *recall*: one host->device copy instead of recomputing the prefill), and queued
requests' pages can be recalled before they are admitted (*prefetch*, ordered by the cache policy).

Page contents are immutable (a page's chain hash names its tokens and its whole prefix), so a page's
KV can be moved and shared by reference. The copies themselves are batched by the engine once per step
(`kv/transfer.py`): the pool only records what must move, in `PendingTransfers`.

Data of one page: numpy [page_size, layers, 2 (k, v), kv_heads, head_dim] in the model's dtype
(slot-major: one contiguous block per page, see kv/transfer.py).

Page buffers are recycled (`PageBuffers`): a page's host memory goes back to a free list when it leaves
the tier, and the next offload of that size copies into it, so a full tier does not allocate (and
first-touch) memory per page. On a 2-core CPU this made no measurable difference against the allocator's
own reuse (benchmarks/host_copy_profile.py); it is not measured on a GPU server. A buffer therefore has
exactly one owner: a page that is the same as another (`same_as`) gets a copy, not a shared array.

Why the host tier is LRU whatever the HBM policy: its job is to hold what HBM could not, and a block
reaches it only after the HBM policy judged it the least likely to be reused soon; past that, recency
is the signal that is left (the DMLP knows nothing beyond its longest horizon, 500 ms by default).
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from stratum_jax.kv.block_meta import BlockMeta


class PageBuffers:
    """Free lists of page-sized host buffers, by (shape, dtype)."""

    def __init__(self):
        self._free: dict[tuple, list[np.ndarray]] = collections.defaultdict(list)

    def get(self, shape: tuple, dtype) -> np.ndarray:
        free = self._free.get((shape, np.dtype(dtype)))
        return free.pop() if free else np.empty(shape, dtype)

    def give(self, buf: np.ndarray | None) -> None:
        if buf is not None:
            self._free[(buf.shape, buf.dtype)].append(buf)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src as raw bits: numpy copies extension dtypes such as ml_dtypes' bfloat16 element by
    element, and the same bytes as unsigned integers in one memcpy."""
    bits = np.dtype(f"u{src.dtype.itemsize}")
    np.copyto(dst.view(bits), src.view(bits))


@dataclasses.dataclass(eq=False)
class HostPage:
    """A page held in host memory. `data` is None until the step's device->host copy fills it: then the
    page's KV is either at `src_slot` of the device cache as it was when this step's scheduling began,
    or the same as another host page's (`same_as`: the page was recalled and evicted again in one pass)."""

    content_hash: bytes
    parent_hash: bytes | None
    page_size: int
    meta: BlockMeta
    data: np.ndarray | None = None
    src_slot: int | None = None
    same_as: "HostPage | None" = None
    in_flight: object | None = None     # the device->host copy under way for it (kv/transfer.py)
    dropped: bool = False               # left the tier: its data is no longer wanted

    def resolved(self, buffers: PageBuffers | None = None) -> np.ndarray:
        """The page's KV [page_size, layers, 2, kv_heads, head_dim]; its copy must have been started."""
        if self.data is None and self.same_as is not None:
            src = self.same_as.resolved(buffers)
            self.data = buffers.get(src.shape, src.dtype) if buffers is not None else np.empty_like(src)
            copy_into(self.data, src)            # its own copy: a buffer has one owner
            self.same_as = None
        if self.data is None and self.in_flight is not None:
            self.in_flight.finish()
        if self.data is None:
            raise RuntimeError(f"host page {self.content_hash.hex()} has no data yet: the engine must run "
                               "the step's device->host copies first")
        return self.data


@dataclasses.dataclass
class PendingTransfers:
    """What moves before the next device step, in this order: `offloads` (device -> host, reading the
    cache as it was when scheduling began) then `recalls` (host -> device, into freshly allocated pages)."""

    offloads: list[HostPage] = dataclasses.field(default_factory=list)
    # Pages evicted again right after their recall in this pass (`same_as` a recall source): they get
    # their copy before the recall sources' buffers are recycled.
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
        self.buffers = PageBuffers()
        self._pages: collections.OrderedDict[bytes, HostPage] = collections.OrderedDict()
        self.tokens = 0
        self.stored = 0        # pages moved in from HBM
        self.recalled = 0      # pages moved back to HBM
        self.dropped = 0       # pages pushed out for lack of room

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
        while self.tokens > self.capacity_tokens:
            _, dropped = self._pages.popitem(last=False)
            self.tokens -= dropped.page_size
            self._drop(dropped)

    def _drop(self, page: HostPage) -> None:
        """A page leaves every tier: its buffer is recycled (a page in the tier is nobody's `same_as`
        source: those are pages taken for a recall)."""
        page.dropped = True
        self.buffers.give(page.data)
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

    def give_back(self, page: HostPage) -> None:
        """Returns a page taken for a recall that could not get HBM room (as the newest: a request just
        asked for it)."""
        self.recalled -= 1
        self._insert(page)

    def pages(self):
        return self._pages.values()
