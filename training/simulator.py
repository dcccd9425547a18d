"""Cache simulator: replays an `AccessStream` against an HBM capacity and a host tier, under a policy.

Model. Requests arrive in stream order. A request uses its blocks all at once: each is an HBM hit, a
host-tier hit (recalled into HBM) or a miss (computed into HBM). Blocks missing from HBM are then
inserted; when HBM is full, the policy picks victims among blocks the current request does not use
(the "running request" of the replay). Victims move to the host tier, which is LRU with its own
capacity (0 = no host tier) and drops its oldest block when full. If every HBM block is in use by the
current request, the remaining new blocks are not kept (they are computed and dropped).

Policies see only the past, except Belady, the offline optimum (evicts the block whose next use is
furthest away; never-used-again blocks first). A hit is counted per block: a cached block is a hit even
when an earlier block of the same prompt missed.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable, Protocol

import numpy as np

from stratum_jax.dmlp.ghost import unprotected_slots
from training.traces import AccessStream


@dataclasses.dataclass
class SimResult:
    """Counts over the scored events (those at index >= `count_from`)."""

    accesses: int = 0
    hits: int = 0          # found in HBM
    host_hits: int = 0     # found on the host tier and recalled

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.accesses, 1)


class Policy(Protocol):
    def touch(self, block: int, event: int) -> None: ...
    def insert(self, block: int, event: int) -> None: ...
    def victims(self, n: int, protected: set[int], event: int) -> list[int]: ...


class LRU:
    def __init__(self):
        self.order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def touch(self, block, event):
        self.order.move_to_end(block)

    def insert(self, block, event):
        self.order[block] = None

    def victims(self, n, protected, event):
        out = []
        for b in self.order:
            if len(out) == n:
                break
            if b not in protected:
                out.append(b)
        for b in out:
            del self.order[b]
        return out


class _HeapPolicy:
    """Evicts the smallest key; keys are re-pushed on change and stale heap entries skipped."""

    def __init__(self):
        self.key: dict[int, tuple] = {}
        self.heap: list = []

    def _set(self, block, key):
        self.key[block] = key
        heapq.heappush(self.heap, (key, block))

    def victims(self, n, protected, event):
        out, held = [], []
        while len(out) < n and self.heap:
            key, b = heapq.heappop(self.heap)
            if self.key.get(b) != key:
                continue
            (held if b in protected else out).append((key, b))
        for item in held:
            heapq.heappush(self.heap, item)
        for _, b in out:
            del self.key[b]
        return [b for _, b in out]


class LFU(_HeapPolicy):
    """Fewest accesses since insertion (the count restarts when a block comes back); ties go to the
    least recently used."""

    def touch(self, block, event):
        self._set(block, (self.key[block][0] + 1, event))

    def insert(self, block, event):
        self._set(block, (1, event))


class Belady(_HeapPolicy):
    """The offline optimum: keeps the blocks used soonest; knows each access's next use."""

    def __init__(self, next_event: np.ndarray):
        super().__init__()
        self.next_event = next_event

    def touch(self, block, event):
        self._set(block, (-int(self.next_event[event]), block))

    insert = touch


class AccessObserver(Protocol):
    """What a replay tells a guarded policy (`DmlpPolicy`): accesses in order, evictions, weight swaps."""

    def guard_accessed(self, block_ids: list, curves: np.ndarray | None = None, t_ms: float = 0.0) -> None: ...
    def forget(self, block_ids) -> None: ...
    def model_changed(self) -> None: ...


class Predicted:
    """The DMLP in a replay. Features at an access do not depend on the cache, so the reuse curves of
    every access are predicted once up front: `curves` [E, H] (by the weights live at each access, for
    an online replay). `order(curves [N, H], idle_ms [N], n, now_ms, cached, access_seq [N]) -> indices
    [n]` picks victims (`DmlpPolicy.order_victims`), here over every cached block that the current
    request does not use. `observer`: the policy whose shadow-LRU guard sees the replay's accesses and
    evictions (None: unguarded); `version` int [E]: the weights' version at each access (online
    replays), so the observer hears of each swap when the replay reaches it.
    """

    def __init__(self, curves: np.ndarray, t_ms: np.ndarray, order: Callable[..., np.ndarray], capacity: int,
                 observer: AccessObserver | None = None, version: np.ndarray | None = None):
        self.curves, self.t_ms, self.order = curves, t_ms, order
        self.block = np.zeros(capacity, np.int64)     # cached blocks in slots [0, n)
        self.event = np.zeros(capacity, np.int64)     # ... and the event of their last access,
        # ... its curve and time, copied per slot: gathering them by event at every request touched
        # rows scattered over the whole stream's arrays (a cache miss per cached block).
        self.slot_curve = np.zeros((capacity,) + curves.shape[1:], curves.dtype)
        self.slot_t = np.zeros(capacity, t_ms.dtype)
        self.n = 0
        self.slot: dict[int, int] = {}
        self.observer, self.version = observer, version
        self._version = 0 if version is None else int(version[0])

    def _seen(self, block, event):
        if self.observer is None:
            return
        if self.version is not None and self.version[event] != self._version:
            self._version = int(self.version[event])
            self.observer.model_changed()
        self.observer.guard_accessed([block], self.curves[event:event + 1], float(self.t_ms[event]))

    def _place(self, i, block, event):
        self.block[i], self.event[i], self.slot_t[i] = block, event, self.t_ms[event]
        self.slot_curve[i] = self.curves[event]

    def touch(self, block, event):
        self._seen(block, event)
        self._place(self.slot[block], block, event)

    def insert(self, block, event):
        self._seen(block, event)
        self.slot[block] = self.n
        self._place(self.n, block, event)
        self.n += 1

    def victims(self, n, protected, event):
        cand = unprotected_slots(self.n, self.slot, protected)   # all but the request's own cached blocks
        if len(cand) == 0:
            return []
        now = self.t_ms[event]
        chosen = cand[self.order(self.slot_curve[cand], now - self.slot_t[cand], n, now, self.n, self.event[cand])]
        out = self.block[chosen].tolist()
        for i in sorted(chosen.tolist(), reverse=True):   # swap-remove, highest slot first
            del self.slot[int(self.block[i])]
            self.n -= 1
            last = self.n
            if i != last:
                self.block[i], self.event[i], self.slot_t[i] = self.block[last], self.event[last], self.slot_t[last]
                self.slot_curve[i] = self.slot_curve[last]
                self.slot[int(self.block[i])] = i
        if self.observer is not None:
            self.observer.forget(out)
        return out


def replay(stream: AccessStream, capacity: int, policy: Policy, host_capacity: int = 0,
           count_from: int = 0, hit_events: np.ndarray | None = None) -> SimResult:
    """Replays `stream` through an HBM cache of `capacity` blocks; counts events from `count_from` on
    (earlier ones only warm the cache). hit_events: bool [E], set True at each HBM hit (for hit rates
    over time)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    hbm: set[int] = set()
    host: collections.OrderedDict[int, None] = collections.OrderedDict()
    res = SimResult()
    req, blocks = stream.request, stream.block.tolist()
    bounds = np.flatnonzero(np.diff(req)) + 1
    starts = [0] + bounds.tolist()
    ends = bounds.tolist() + [len(req)]
    for a, b in zip(starts, ends):
        scored = a >= count_from
        missing, pending = [], set()
        for e in range(a, b):
            blk = blocks[e]
            if blk in hbm or blk in pending:   # a repeat inside one request reuses what it just made
                if blk in hbm:
                    policy.touch(blk, e)
                res.hits += scored
                if hit_events is not None:
                    hit_events[e] = True
            else:
                if blk in host:
                    del host[blk]
                    res.host_hits += scored
                missing.append(e)
                pending.add(blk)
        res.accesses += (b - a) * scored
        need = len(hbm) + len(missing) - capacity
        if need > 0:
            for v in policy.victims(need, set(blocks[a:b]), a):
                hbm.discard(v)
                if host_capacity:
                    host[v] = None
                    if len(host) > host_capacity:
                        host.popitem(last=False)
        for e in missing:
            if len(hbm) < capacity:
                hbm.add(blocks[e])
                policy.insert(blocks[e], e)
    return res
