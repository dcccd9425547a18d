"""The shadow-LRU guard: the DMLP policy falls back to LRU order while it evicts worse than LRU would.

A ghost LRU directory (block keys only, no data) sees every block access the real cache sees, and holds
as many blocks as the real cache does now (its resident set: blocks accessed and not yet forgotten,
i.e. not yet out of every tier). Over each window of `window` accesses (the window slides by its own
length) the guard counts two hit rates: the real cache's (the key was resident before this access) and
the ghost's (the key was in the ghost).

When to trip. A window *trails* when the ghost's hits exceed the real ones by more than `margin` x
window. At the end of a window in DMLP mode the guard switches the policy to LRU order when the last
`confirm` windows all trail and, pooled, by more than `z` standard errors of a paired sign test (the
accesses that only one of the two hit are the ones that differ; under "no difference" their split is a
fair coin, so the excess has standard deviation sqrt(discordant)). Both conditions keep noise and
short bad stretches from tripping it: a DMLP that is ahead on average still trails in some windows
(on the trained Mooncake part a one-window rule at z = 3 tripped 10-12 times and gave back 0.8-1.7
points of lead), and a trip costs whatever the DMLP was ahead by. A probe (below) is judged on its one
window alone, so that a model already found worse costs one window per probe, not `confirm`.

When to return. In LRU mode the real cache *is* LRU, so it cannot show how the DMLP would do; only a
probe (a window of the DMLP again) can. A probe of a model already found worse costs about a window at
its known loss, so a rule that probes on a timer loses more the longer the run (it did: 0.53 points below
LRU at 3,000 requests of the wrong-checkpoint load, 0.88 at 6,000, with a probe every 4 x backoff
windows). Probes here are paid for:
- after a weight swap (an online round changed the model, the thing that can make it better), once
  `backoff` windows have passed since the trip: each costs at most a window, one per swap that reached
  LRU mode, and a probe that trails again doubles `backoff` (up to `max_backoff`);
- an unchanged model, after 4 x `backoff` windows, only from its credit: the guard keeps `credit`, the
  real cache's hits minus the ghost LRU's over the windows the DMLP chose the victims in (what it earned
  over LRU; an LRU-mode window counts only when the real cache trails there, the aftermath of the
  DMLP's evictions), and probes an unchanged model only while the credit covers the loss of one window at
  the rate measured when it last tripped, apart from `free_probes` (default 1) per run, so that a trip
  before the model could earn anything (on a cold cache, say) is not final by itself. So a model that never
  earned a lead (the wrong checkpoint) gets one more window, then never again, and its loss is the
  windows before its trip plus one probe, whatever the run's length; one that
  earned a lead and then trailed (a workload that moves between what the model knows and what it does
  not) may spend that lead on probes, but never more than it earned plus the free probe and one more: the
  guarded cache's cumulative hits stay within the detection windows and two probes (with their
  aftermath) of LRU's.
A probe that holds a full window resets `backoff`.

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
    confirm: consecutive trailing windows (pooled for the z test) that trip it from DMLP mode.
    free_probes: probes of an unchanged model allowed without credit, per run (a trip before the
    model could earn a lead, e.g. on a cold cache, is not final).
    backoff / max_backoff: windows in LRU mode before a probe (after a weight swap; 4x that for an
    unchanged model, which also needs the credit) after the first trip / at most."""

    def __init__(self, window: int = 2048, margin: float = 0.005, z: float = 3.0, confirm: int = 2,
                 backoff: int = 1, max_backoff: int = 16, free_probes: int = 1):
        if window < 1:
            raise ValueError(f"guard window must be >= 1 access, got {window}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"guard margin must lie in [0, 1), got {margin}")
        if not z >= 0:
            raise ValueError(f"guard z must be >= 0, got {z}")
        if free_probes < 0:
            raise ValueError(f"guard free_probes must be >= 0, got {free_probes}")
        if confirm < 1:
            raise ValueError(f"guard confirm must be >= 1 window, got {confirm}")
        if not 1 <= backoff <= max_backoff:
            raise ValueError(f"guard backoff must satisfy 1 <= backoff <= max_backoff, got {backoff}, {max_backoff}")
        self.window, self.margin, self.z, self.confirm = window, margin, z, confirm
        self._backoff0, self.max_backoff, self._free0 = backoff, max_backoff, free_probes
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
        self.credit = 0                   # real hits - ghost LRU hits the DMLP earned (see _judge)
        self._probe_cost = 0.0            # hits a window of the DMLP lost when it last tripped
        self.free_probes = free_probes    # unchanged-model probes left that need no credit
        self._probing = False
        self._trailing: collections.deque = collections.deque(maxlen=confirm)   # (excess, discordant)

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
        excess, discordant = self._lru_hits - self._real_hits, self._discordant
        self._n = self._real_hits = self._lru_hits = self._discordant = 0
        # In LRU mode a real cache ahead of the ghost is not the DMLP's doing (the engine's LRU keeps
        # pages that running requests hold, the ghost does not): it funds no probe. Behind the ghost it
        # is the aftermath of the DMLP's evictions (a probe's lost pages), and is charged.
        self.credit -= max(excess, 0) if self.active else excess
        if self.active:
            self._lru_windows += 1
            swapped = self._model_changed and self._lru_windows >= self.backoff
            waited = self._lru_windows >= 4 * self.backoff
            funded = waited and (self.credit >= self._probe_cost or self.free_probes > 0)
            if funded and not swapped and self.credit < self._probe_cost:
                self.free_probes -= 1
            if swapped or funded:
                self.active, self._probing = False, True
                self.probes += 1
                self._trailing.clear()
            return
        if excess <= self.margin * w:
            self._trailing.clear()
            if self._probing:             # a full window at par: the DMLP is trusted again
                self._probing = False
                self.backoff = self._backoff0
            return
        self._trailing.append((excess, discordant))
        need = 1 if self._probing else self.confirm
        pooled_excess = sum(e for e, _ in self._trailing)
        pooled_discordant = sum(d for _, d in self._trailing)
        if len(self._trailing) < need or pooled_excess <= self.z * math.sqrt(pooled_discordant):
            return
        if self._probing:                 # the probe did not hold: wait longer next time
            self.backoff = min(2 * self.backoff, self.max_backoff)
        self._probe_cost = pooled_excess / len(self._trailing)
        self.active, self._probing = True, False
        self.trips += 1
        self._lru_windows = 0
        self._model_changed = False
        self._trailing.clear()

    # ---- what it reports ----

    def settings(self) -> dict:
        """The trip and probe rule, for reports."""
        return {"window": self.window, "margin": self.margin, "z": self.z, "confirm": self.confirm,
                "backoff": self._backoff0, "max_backoff": self.max_backoff, "free_probes": self._free0, "probes": "after a weight swap, or an unchanged model from its credit"}

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
