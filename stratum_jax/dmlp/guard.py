"""The shadow-LRU guard: the DMLP policy falls back to LRU order while it evicts worse than LRU would,
and returns to the DMLP when a ghost of the DMLP's cache shows it would now do better.

Two ghosts (keys only, no data) see every block access the real cache sees and hold as many blocks as
the real cache does now (its resident set: blocks accessed and not yet forgotten, i.e. not yet out of
every tier): a ghost LRU, and a ghost DMLP cache (ghost.py, `GhostDmlpCache`), which ranks its own
victims by the DMLP's score while the real cache is in LRU order, and mirrors the real cache while the
real cache is the DMLP's. Over each window of `window` accesses (the window slides by its own length)
the guard counts three hit rates: the real cache's (the key was resident before this access), the
ghost LRU's and the ghost DMLP's.

When to trip. In DMLP mode a window *trails* when the ghost LRU's hits exceed the real ones by more than
`margin` x window. The guard switches the policy to LRU order when the last `confirm` windows all trail
and, pooled, by more than `z` standard errors of a paired sign test (the accesses that only one of the
two hit are the ones that differ; under "no difference" their split is a fair coin, so the excess has
standard deviation sqrt(discordant)). Both conditions keep noise and short bad stretches from tripping
it: a DMLP that is ahead on average still trails in some windows (on the trained Mooncake part a
one-window rule at z = 3 tripped 10-12 times and gave back 0.8-1.7 points of lead).

When to return: the mirror image, judged on the ghost DMLP. In LRU mode a window *leads* when the ghost
DMLP's hits exceed the real (LRU) cache's by more than `margin` x window; the guard returns to the DMLP
when the last `confirm` windows all lead and, pooled, by more than `z` standard errors of the same
paired test (real against ghost DMLP). Why this rule:
- It spends no real windows. Session 6's guard could only learn how the DMLP would do by handing it
  the real cache for a window (a probe), so every look at a model still worse than LRU cost a window at
  its loss, and the rule that rationed probes (credit earned over LRU, one free probe) gave a model that
  tripped early, before it had earned credit, no way back: on the trained Mooncake part at capacity 0.1
  it tripped in the warm-up and stayed LRU, giving back its whole +4.18-point lead. The ghost looks for
  free, every window, at any model, swapped or not.
- It compares with the real cache, not with the ghost LRU, because the real cache is what a return
  gives up. In the replay the two agree; in the engine the real LRU also keeps the pages running
  requests hold, which the ghosts do not, so there the comparison leans towards staying in LRU mode,
  the safe side.
- A lead, not par, and as much evidence as a trip needs: at par LRU is kept (the known-safe policy), and
  a return costs at most the `confirm` windows that would trip it again if the ghost misled, so
  flapping needs the evidence to flip both ways, each flip paying at most `confirm` windows.
- The ghost starts, at the trip, as exactly the cache the DMLP built (it mirrored it), so the first
  windows after a trip compare the two policies from the same contents.
A guarded cache's loss to LRU is therefore the detection windows before each trip; trips after the
first need the ghost to have led for `confirm` windows first.

Why switch and not blend. While the guard is on, the real cache is an LRU cache, so the guarded
policy's loss to LRU is bounded by how long the DMLP runs while it trails. A blend of the DMLP's score
with recency has no such bound: any weight on a model that is worse than LRU may still lose, and the
weight that would not is unknown (it depends on the workload, the very thing that shifted).

`judge_from_ms`: windows that end before this time publish their rates but neither trip nor return the
guard (a replay's warm-up, when asked; see training/evaluate.py).

Both the engine (through `DmlpPolicy.observe_access` and `forget`) and the cache simulator feed the
same object. Not thread-safe: called from the engine thread (or the replay) only; metrics read floats.
"""
from __future__ import annotations

import collections
import math
from typing import Hashable, Iterable, Sequence

import numpy as np

from stratum_jax.dmlp.ghost import GhostDmlpCache

_NO_HITS = [False]


class ShadowLruGuard:
    """window: accesses per judgement. margin: how far (absolute hit rate, 0.005 = half a point) the
    DMLP may trail the ghost LRU in a window (and must lead it, as a ghost, to return). z: the trail (the
    lead) must also exceed z standard errors. confirm: consecutive trailing (leading) windows, pooled
    for the z test, that trip (return) it. ghost: the ghost DMLP cache (`DmlpPolicy` gives the guard one
    ranked by its own model; without one the guard, once tripped, stays in LRU mode). judge_from_ms:
    see the module doc."""

    def __init__(self, window: int = 2048, margin: float = 0.005, z: float = 3.0, confirm: int = 2,
                 ghost: GhostDmlpCache | None = None, judge_from_ms: float = -math.inf):
        if window < 1:
            raise ValueError(f"guard window must be >= 1 access, got {window}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"guard margin must lie in [0, 1), got {margin}")
        if not z >= 0:
            raise ValueError(f"guard z must be >= 0, got {z}")
        if confirm < 1:
            raise ValueError(f"guard confirm must be >= 1 window, got {confirm}")
        self.window, self.margin, self.z, self.confirm = window, margin, z, confirm
        self.judge_from_ms = judge_from_ms
        self.ghost = ghost
        self.active = False              # True: the policy evicts in LRU order
        self.trips = 0                   # switches to LRU
        self.returns = 0                 # switches back to the DMLP
        self.swaps = 0                   # weight swaps seen (online rounds that changed the model)
        self._resident: set = set()
        self._lru: collections.OrderedDict = collections.OrderedDict()    # the ghost LRU
        # The current window: accesses, real / ghost LRU / ghost DMLP hits, and the discordant pairs of
        # real against each ghost.
        self._n = self._real_hits = self._lru_hits = self._ghost_hits = 0
        self._disc_lru = self._disc_ghost = 0
        self.dmlp_hit_rate = self.lru_hit_rate = self.ghost_hit_rate = math.nan   # the last full window
        self._run: collections.deque = collections.deque(maxlen=confirm)         # (excess, discordant)

    def bind(self, ghost: GhostDmlpCache) -> None:
        """Gives the guard its ghost DMLP (before the first access), mirroring the real cache."""
        if self._n or self._resident:
            raise RuntimeError("bind the ghost DMLP before the guard sees accesses")
        self.ghost = ghost

    # ---- what the cache reports ----

    def accessed(self, keys: Sequence[Hashable], curves: np.ndarray | None = None, t_ms: float = 0.0,
                 features: Sequence | None = None) -> None:
        """Blocks used, in order, at t_ms (one request or engine step; curves [N, H]: the DMLP's reuse
        curves at this access, None when not computed; features: else their per-access feature records,
        for the ghost DMLP to score when it ranks): each counts as a real hit if it was resident, and as a
        ghost hit for each ghost that held it; all then hold it."""
        resident, lru, ghost = self._resident, self._lru, self.ghost
        ghost_hit = ghost.access(keys, curves, t_ms, features) if ghost is not None else _NO_HITS * len(keys)
        for i, k in enumerate(keys):
            real_hit = k in resident
            lru_hit = k in lru
            resident.add(k)
            if lru_hit:
                lru.move_to_end(k)
            else:
                lru[k] = None
            while len(lru) > len(resident):       # the real cache may have shrunk since (forget)
                lru.popitem(last=False)
            self._n += 1
            self._real_hits += real_hit
            self._lru_hits += lru_hit
            self._ghost_hits += ghost_hit[i]
            self._disc_lru += real_hit != lru_hit
            self._disc_ghost += real_hit != ghost_hit[i]
            if self._n == self.window:
                self._judge(t_ms)
        if ghost is not None and not ghost.mirror:
            ghost.fit(len(resident), set(keys), t_ms)

    def note_curves(self, keys: Sequence[Hashable], curves: np.ndarray, t_ms: Sequence[float]) -> None:
        """Curves [N, H] the policy computed for accesses at t_ms [N] (lazily, when it ranked them)."""
        if self.ghost is not None:
            self.ghost.note_curves(keys, curves, t_ms)

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Blocks that left the real cache (the ghost LRU shrinks with it, oldest first, at the next
        access; the ghost DMLP drops them too while it mirrors the real cache)."""
        keys = list(keys)
        for k in keys:
            self._resident.discard(k)
        if self.ghost is not None:
            self.ghost.forget(keys)

    def model_changed(self) -> None:
        """The DMLP's weights changed (an online swap). Nothing to re-arm: the ghost ranks with the curves
        of whatever weights were live at each access, as the real policy would; counted for reports."""
        self.swaps += 1

    # ---- the decision ----

    def _judge(self, now_ms: float) -> None:
        """The end of a window: publish its rates, then trip, return or stay."""
        w = self._n
        self.dmlp_hit_rate, self.lru_hit_rate = self._real_hits / w, self._lru_hits / w
        self.ghost_hit_rate = self._ghost_hits / w if self.ghost is not None else math.nan
        if self.active:       # the ghost DMLP against the real (LRU) cache
            excess, discordant = self._ghost_hits - self._real_hits, self._disc_ghost
        else:                 # the ghost LRU against the real (DMLP) cache
            excess, discordant = self._lru_hits - self._real_hits, self._disc_lru
        self._n = self._real_hits = self._lru_hits = self._ghost_hits = self._disc_lru = self._disc_ghost = 0
        if now_ms < self.judge_from_ms or (self.active and self.ghost is None):
            self._run.clear()
            return
        if excess <= self.margin * w:
            self._run.clear()
            return
        self._run.append((excess, discordant))
        pooled_excess = sum(e for e, _ in self._run)
        pooled_discordant = sum(d for _, d in self._run)
        if len(self._run) < self.confirm or pooled_excess <= self.z * math.sqrt(pooled_discordant):
            return
        if self.active:
            self.untrip()
        else:
            self.trip()

    def trip(self) -> None:
        """Switches to LRU order now (what a judged trip does; also for a benchmark that measures LRU
        mode's cost): the ghost DMLP, until now the real cache's mirror, starts evicting by itself."""
        self._run.clear()
        self.active = True
        self.trips += 1
        if self.ghost is not None:
            self.ghost.mirror = False

    def untrip(self) -> None:
        """Returns to the DMLP now (what a judged return does): the ghost mirrors the real cache again."""
        self._run.clear()
        self.active = False
        self.returns += 1
        if self.ghost is not None:
            self.ghost.start_mirroring(self._resident)

    # ---- what it reports ----

    def settings(self) -> dict:
        """The trip and probe rule, for reports."""
        return {"window": self.window, "margin": self.margin, "z": self.z, "confirm": self.confirm,
                "return": "when a ghost DMLP cache leads the real (LRU-mode) cache by the trip rule's margin and z",
                "ghost_slack_frac": self.ghost.slack_frac if self.ghost is not None else None}

    def export(self, registry) -> None:
        """Registers stratum_dmlp_guard_active and the three hit rates of the last full window (real, ghost
        LRU, ghost DMLP) in a prometheus_client registry."""
        import prometheus_client as prom
        prom.Gauge("stratum_dmlp_guard_active", "1 while the shadow-LRU guard has the DMLP policy evict in "
                   "LRU order.", registry=registry).set_function(lambda: float(self.active))
        prom.Gauge("stratum_dmlp_guard_dmlp_hit_rate", "Prefix-cache hit rate of the live policy over the "
                   "guard's last full window.", registry=registry).set_function(lambda: self.dmlp_hit_rate)
        prom.Gauge("stratum_dmlp_guard_lru_hit_rate", "Hit rate a ghost LRU of the same size would have had "
                   "over the same accesses.", registry=registry).set_function(lambda: self.lru_hit_rate)
        prom.Gauge("stratum_dmlp_guard_ghost_dmlp_hit_rate", "Hit rate a ghost cache evicting by the DMLP "
                   "would have had over the same accesses (while the guard is active; the live policy's own "
                   "rate while it is not).", registry=registry).set_function(lambda: self.ghost_hit_rate)
