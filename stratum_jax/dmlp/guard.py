"""The shadow-LRU guard: the DMLP policy falls back to LRU order while it evicts worse than LRU would.

A ghost LRU directory (block keys only, no data) sees every block access the real cache sees, and holds
as many blocks as the real cache does now (its resident set: blocks accessed and not yet forgotten,
i.e. not yet out of every tier). Over each window of `window` accesses (the window slides by its own
length) the guard counts two hit rates: the real cache's (the key was resident before this access) and
the ghost's (the key was in the ghost).

When to trip. At the end of a window in DMLP mode the guard switches the policy to LRU order when the
ghost's hits exceed the real ones by more than `margin` x window, and by more than `z` standard errors
of a paired sign test (the accesses that only one of the two hit are the ones that differ; under "no
difference" their split is a fair coin, so the excess has standard deviation sqrt(discordant)). The
second condition keeps noise from tripping it: a DMLP that is ahead on average still trails in some
windows, and a trip costs whatever the DMLP was ahead by.

When to return. In LRU mode the real cache *is* LRU, so it cannot show how the DMLP would do. The guard
probes (gives the DMLP a window again) after `backoff` windows once the model changed (an online weight
swap: the thing that can make it better), or after 4 x `backoff` windows without a change (the
workload may have moved back towards what the model knows, and a trip by bad luck is undone). A probe
that trails again doubles `backoff` (up to `max_backoff`); one that holds resets it.

Why switch and not blend. While the guard is on, the real cache is an LRU cache, so the guarded
policy's loss to LRU is bounded by how long the DMLP runs while it trails: the detecting window and the
probes, each one window long, rarer and rarer as the backoff doubles. A blend of the DMLP's score with
recency has no such bound: any weight on a model that is worse than LRU may still lose, and the weight
that would not is unknown (it depends on the workload, the very thing that shifted).

Both the engine (through `DmlpPolicy.observe_access` and `forget`) and the cache simulator feed the
same object. Not thread-safe: called from the engine thread (or the replay) only; metrics read floats.
"""
from __future__ import annotations

import collections
import math
from typing import Hashable, Iterable, Sequence


class ShadowLruGuard:
    """window: accesses per judgement. margin: how far (absolute hit rate, 0.005 = half a point) the
    DMLP may trail the ghost LRU in a window. z: the trail must also exceed z standard errors.
    backoff / max_backoff: windows in LRU mode before a probe after the first trip / at most."""

    def __init__(self, window: int = 2048, margin: float = 0.005, z: float = 3.0, backoff: int = 1,
                 max_backoff: int = 16):
        if window < 1:
            raise ValueError(f"guard window must be >= 1 access, got {window}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"guard margin must lie in [0, 1), got {margin}")
        if not z >= 0:
            raise ValueError(f"guard z must be >= 0, got {z}")
        if not 1 <= backoff <= max_backoff:
            raise ValueError(f"guard backoff must satisfy 1 <= backoff <= max_backoff, got {backoff}, {max_backoff}")
        self.window, self.margin, self.z = window, margin, z
        self._backoff0, self.max_backoff = backoff, max_backoff
        self.backoff = backoff
        self.active = False              # True: the policy evicts in LRU order
        self.trips = 0                   # switches to LRU
        self.probes = 0                  # switches back to the DMLP
        self._resident: set = set()
        self._ghost: collections.OrderedDict = collections.OrderedDict()
        self._n = self._real_hits = self._lru_hits = self._discordant = 0    # the current window
        self.dmlp_hit_rate = self.lru_hit_rate = math.nan                     # the last full window
        self._model_changed = False
        self._lru_windows = 0             # full windows since the last trip
        self._probing = False

    # ---- what the cache reports ----

    def accessed(self, keys: Sequence[Hashable]) -> None:
        """Blocks used, in order: each counts as a real hit if it was resident, and as a ghost hit if the
        ghost LRU held it; both then hold it."""
        resident, ghost = self._resident, self._ghost
        for k in keys:
            real_hit = k in resident
            lru_hit = k in ghost
            resident.add(k)
            if lru_hit:
                ghost.move_to_end(k)
            else:
                ghost[k] = None
            while len(ghost) > len(resident):     # the real cache may have shrunk since (forget)
                ghost.popitem(last=False)
            self._n += 1
            self._real_hits += real_hit
            self._lru_hits += lru_hit
            self._discordant += real_hit != lru_hit
            if self._n == self.window:
                self._judge()

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Blocks that left the real cache (the ghost shrinks with it, oldest first, at the next access)."""
        for k in keys:
            self._resident.discard(k)

    def model_changed(self) -> None:
        """The DMLP's weights changed (an online swap): LRU mode may probe it again."""
        self._model_changed = True

    # ---- the decision ----

    def _judge(self) -> None:
        """The end of a window: publish its rates, then trip, probe or stay."""
        w = self._n
        self.dmlp_hit_rate, self.lru_hit_rate = self._real_hits / w, self._lru_hits / w
        excess = self._lru_hits - self._real_hits
        trails = excess > self.margin * w and excess > self.z * math.sqrt(self._discordant)
        self._n = self._real_hits = self._lru_hits = self._discordant = 0
        if self.active:
            self._lru_windows += 1
            if self._lru_windows >= self.backoff * (1 if self._model_changed else 4):
                self.active, self._probing = False, True
                self.probes += 1
        elif trails:
            if self._probing:             # the probe did not hold: wait longer next time
                self.backoff = min(2 * self.backoff, self.max_backoff)
            self.active, self._probing = True, False
            self.trips += 1
            self._lru_windows = 0
            self._model_changed = False
        elif self._probing:               # a full window at par: the DMLP is trusted again
            self._probing = False
            self.backoff = self._backoff0

    # ---- what it reports ----

    def export(self, registry) -> None:
        """Registers stratum_dmlp_guard_active and the two hit rates of the last full window in a
        prometheus_client registry."""
        import prometheus_client as prom
        prom.Gauge("stratum_dmlp_guard_active", "1 while the shadow-LRU guard has the DMLP policy evict in "
                   "LRU order.", registry=registry).set_function(lambda: float(self.active))
        prom.Gauge("stratum_dmlp_guard_dmlp_hit_rate", "Prefix-cache hit rate of the live policy over the "
                   "guard's last full window.", registry=registry).set_function(lambda: self.dmlp_hit_rate)
        prom.Gauge("stratum_dmlp_guard_lru_hit_rate", "Hit rate a ghost LRU of the same size would have had "
                   "over the same accesses.", registry=registry).set_function(lambda: self.lru_hit_rate)
