"""Cache policies that answer the engine's narrow questions: which blocks to evict, which host-tier
blocks to prefetch first, which page size a request gets. `DmlpPolicy` answers from the predictor;
`LruPolicy` is the plain baseline with the same interface.

Eviction by hit density. Evicting the block least likely to be reused "soon" needs a notion of soon:
the cache's own eviction age A (how long blocks sit idle before they are evicted, tracked as a moving
average). For each candidate the policy reads the predicted reuse curve P(reuse within h) at A and
divides by the expected time the block holds its slot before that reuse or A, whichever comes first:

    density = P(T <= A) / E[min(T, A)],  E[min(T, A)] = integral_0^A (1 - P(T <= t)) dt

A block reused quickly is worth more per unit of occupied space than one reused late (the "hit
density" of LHD, Beckmann et al., NSDI'18). P between horizons is linear; A is clipped to the
horizons, since nothing is known past the longest.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from stratum_jax.config import PAGE_SIZE_CLASSES
from stratum_jax.dmlp.features import FEATURE_NAMES, BlockInfo, columns_from_infos, raw_features
from stratum_jax.dmlp.model import Predictor
from stratum_jax.kv.page_size import DefaultPageSizeRule, PageSizeHints

_SINCE_LAST = FEATURE_NAMES.index("since_last_ms")


def hit_density(probs: np.ndarray, horizons_ms: Sequence[float], age_ms: float) -> np.ndarray:
    """probs: [N, H] P(reuse within horizons_ms[k]), non-decreasing in k. Returns [N] densities (1/ms)."""
    h = np.asarray(horizons_ms, np.float64)
    a = float(np.clip(age_ms, h[0], h[-1]))
    grid = np.concatenate([[0.0], h])                                  # [H+1]
    p = np.concatenate([np.zeros((len(probs), 1)), probs], axis=1)     # [N, H+1]
    j = int(np.searchsorted(grid, a))                                  # grid[j-1] < a <= grid[j]
    w = (a - grid[j - 1]) / (grid[j] - grid[j - 1])
    p_a = p[:, j - 1] * (1 - w) + p[:, j] * w                         # [N]
    pts = np.minimum(grid, a)                                          # clip the grid at a
    pc = np.where(grid[None, :] < a, p, p_a[:, None])
    surv = 1.0 - 0.5 * (pc[:, 1:] + pc[:, :-1])                       # mean survival per segment
    expected_hold = (surv * np.diff(pts)[None, :]).sum(1)
    return p_a / np.maximum(expected_hold, 1e-9)


class ConfidenceThreshold:
    """The hot/cold threshold on P(reuse within the decision horizon) (`stratum_dmlp_confidence`).

    `calibrate` moves it towards the threshold that classifies recent outcomes best, at most `step`
    per call and never outside [low, high], so a burst of odd traffic cannot swing it far. Thread-safe.
    """

    def __init__(self, value: float = 0.75, low: float = 0.5, high: float = 0.95, step: float = 0.05):
        if not low <= value <= high:
            raise ValueError(f"confidence {value} must lie in [{low}, {high}]")
        self.low, self.high, self.step = low, high, step
        self._value = value
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        return self._value

    def calibrate(self, probs: np.ndarray, reused: np.ndarray) -> float:
        """probs, reused: [N] predictions and outcomes (0/1) at the decision horizon."""
        grid = np.linspace(self.low, self.high, 19)
        acc = ((probs[None, :] >= grid[:, None]) == (reused[None, :] > 0.5)).mean(1)
        best = grid[np.flatnonzero(acc == acc.max())]
        with self._lock:
            target = best[np.argmin(np.abs(best - self._value))]
            self._value = float(np.clip(target, self._value - self.step, self._value + self.step))
            return self._value

    def export(self, registry) -> None:
        """Registers the `stratum_dmlp_confidence` gauge in a prometheus_client registry."""
        import prometheus_client as prom
        prom.Gauge("stratum_dmlp_confidence", "DMLP hot/cold threshold on P(reuse within the decision "
                   "horizon).", registry=registry).set_function(lambda: self._value)


class LruPolicy:
    """The baseline: evict the least recently used, prefetch the most recently used first."""

    def choose_victims(self, candidates: Sequence[BlockInfo], n: int, now_ms: float) -> list:
        free = [b for b in candidates if not b.needed_by_running]
        return [b.block_id for b in sorted(free, key=lambda b: b.last_access_ms)[:n]]

    def prefetch_order(self, candidates: Sequence[BlockInfo], now_ms: float) -> list:
        return [b.block_id for b in sorted(candidates, key=lambda b: -b.last_access_ms)]

    def page_size_for(self, hints: PageSizeHints, prefix_blocks: Sequence[BlockInfo] = (),
                      now_ms: float = 0.0) -> int:
        return DefaultPageSizeRule()(hints)


class DmlpPolicy:
    """Eviction, prefetch and page size from predicted reuse.

    predictor: the DMLP (its params may be hot-swapped by the online fine-tuner at any time).
    decision_horizon: index of the horizon whose probability is compared with the confidence
    threshold (hot = P >= threshold) for prefetch and page size.
    """

    def __init__(self, predictor: Predictor, threshold: ConfidenceThreshold | None = None,
                 decision_horizon: int = -1, age_smoothing: float = 0.05):
        self.predictor = predictor
        self.threshold = threshold or ConfidenceThreshold()
        self.horizons_ms = predictor.config.horizons_ms
        self.decision_horizon = decision_horizon
        self.eviction_age_ms = self.horizons_ms[-1]   # until the first evictions say otherwise
        self._smoothing = age_smoothing

    # ---- array level (the simulator calls these directly) ----

    def pick_victims(self, raw: np.ndarray, n: int) -> np.ndarray:
        """raw: [N, F] candidate features at now (none needed by a running request). Returns the
        indices of the n lowest hit densities, lowest first, and updates the eviction age."""
        dens = hit_density(self.predictor.predict(raw), self.horizons_ms, self.eviction_age_ms)
        order = np.argsort(dens, kind="stable")[:n]
        idle = raw[order, _SINCE_LAST]
        if len(idle):
            self.eviction_age_ms += self._smoothing * (float(np.nanmean(idle)) - self.eviction_age_ms)
        return order

    # ---- engine level ----

    def choose_victims(self, candidates: Sequence[BlockInfo], n: int, now_ms: float) -> list:
        free = [b for b in candidates if not b.needed_by_running]
        if not free or n <= 0:
            return []
        raw = raw_features(columns_from_infos(free), now_ms)
        return [free[i].block_id for i in self.pick_victims(raw, n)]

    def prefetch_order(self, candidates: Sequence[BlockInfo], now_ms: float) -> list:
        """Host-tier blocks of queued requests, most likely reused first; cold blocks are left out."""
        if not candidates:
            return []
        p = self._decision_probs(candidates, now_ms)
        order = np.argsort(-p, kind="stable")
        return [candidates[i].block_id for i in order if p[i] >= 1.0 - self.threshold.value]

    def page_size_for(self, hints: PageSizeHints, prefix_blocks: Sequence[BlockInfo] = (),
                      now_ms: float = 0.0) -> int:
        """The default rule, then one class smaller when the request's prefix blocks are hot (they will
        be shared again: finer pages share at a finer grain) and one class larger when they are cold."""
        size = DefaultPageSizeRule()(hints)
        if not prefix_blocks:
            return size
        p = float(np.mean(self._decision_probs(prefix_blocks, now_ms)))
        i = PAGE_SIZE_CLASSES.index(size)
        if p >= self.threshold.value:
            i -= 1
        elif p < 1.0 - self.threshold.value:
            i += 1
        return PAGE_SIZE_CLASSES[min(max(i, 0), len(PAGE_SIZE_CLASSES) - 1)]

    def _decision_probs(self, blocks: Sequence[BlockInfo], now_ms: float) -> np.ndarray:
        raw = raw_features(columns_from_infos(blocks), now_ms)
        return self.predictor.predict(raw)[:, self.decision_horizon]


