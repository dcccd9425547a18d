"""Cache policies that answer the engine's narrow questions: which blocks to evict, which host-tier
blocks to prefetch first, which page size a request gets. `DmlpPolicy` answers from the predictor;
`LruPolicy` (stratum_jax/cache_policy.py) is the plain baseline with the same interface, the
`CachePolicy` protocol.

How predictions become evictions. The model runs once per access (`observe_access`, batched per
request) and gives the block's reuse curve F(h) = P(next use within h of that access). An idle block
is then scored without running the model again: after `idle` ms without a use, the chance that it is
used within the next `window` ms is

    (F(idle + window) - F(idle)) / (1 - F(idle)),   F linear between horizons, flat past the longest.

The eviction score asks "will it be used before it would leave the cache anyway?". How long a block
still stays is not one number: the cache's residency R (Little's law: cached blocks / eviction rate) is
only its mean, and blocks the policy keeps stay longer than those it drops. So the time left is taken as
exponential with mean R, and the score is P(used within that time), averaged over the quartile
midpoints of that distribution (windows 0.13, 0.47, 0.98 and 2.08 x R: `EVICTION_WINDOW_MULTIPLES`,
`reuse_before_eviction`). Chosen on the training part of the Mooncake trace over a single window R
(see benchmarks/DMLP_NOTES.md, section 6). Victims are the lowest scores; ties, which include every
block idle past the longest horizon (the model knows nothing there, so its score is 0), go to the least
recently used. A cache whose victims are all that old therefore behaves exactly like LRU.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Sequence

import numpy as np

from stratum_jax.config import PAGE_SIZE_CLASSES
from stratum_jax.block_info import BlockInfo
from stratum_jax.dmlp.features import raw_from_infos
from stratum_jax.dmlp.ghost import GhostDmlpCache
from stratum_jax.dmlp.guard import ShadowLruGuard
from stratum_jax.page_size import DefaultPageSizeRule, PageSizeHints

if TYPE_CHECKING:     # the model pulls in flax; the page pool imports this module and needs none of it
    from stratum_jax.dmlp.model import Predictor


def curve_at(curves: np.ndarray, horizons_ms: Sequence[float], t_ms: np.ndarray) -> np.ndarray:
    """F(t) per row: curves [N, H] = F at horizons_ms, F(0) = 0, linear between, flat past the end.
    t_ms: [N] or scalar. Returns [N]."""
    grid = np.concatenate([[0.0], np.asarray(horizons_ms, np.float64)])
    f = np.concatenate([np.zeros((len(curves), 1)), curves], axis=1)
    t = np.clip(np.broadcast_to(np.asarray(t_ms, np.float64), (len(curves),)), 0.0, grid[-1])
    j = np.clip(np.searchsorted(grid, t, side="right"), 1, len(grid) - 1)
    w = (t - grid[j - 1]) / (grid[j] - grid[j - 1])
    rows = np.arange(len(curves))
    return f[rows, j - 1] * (1.0 - w) + f[rows, j] * w


def reuse_within(curves: np.ndarray, horizons_ms: Sequence[float], idle_ms: np.ndarray,
                 window_ms: float) -> np.ndarray:
    """P(used in the next window_ms | idle for idle_ms since the access that predicted `curves`), [N]."""
    f0 = curve_at(curves, horizons_ms, idle_ms)
    f1 = curve_at(curves, horizons_ms, idle_ms + window_ms)
    return (f1 - f0) / np.maximum(1.0 - f0, 1e-9)


# Windows, in units of the residency, over which `reuse_before_eviction` averages: the midpoints of the
# four quartiles of an exponential distribution with mean 1, -ln(1 - (i + 0.5) / 4).
EVICTION_WINDOW_MULTIPLES = tuple(float(-np.log(1.0 - (i + 0.5) / 4)) for i in range(4))


def reuse_before_eviction(curves: np.ndarray, horizons_ms: Sequence[float], idle_ms: np.ndarray,
                          residency_ms: float, multiples: Sequence[float] = EVICTION_WINDOW_MULTIPLES) -> np.ndarray:
    """The eviction score [N]: P(used in the next t ms | idle for idle_ms), averaged over t = residency_ms
    x each of `multiples` (the time a block still stays, taken as exponential with mean residency_ms).
    0 for a block idle past the longest horizon, as `reuse_within` is.

    The same arithmetic as `curve_at` at idle_ms and at each window's end, in one pass over [1 + K, N]
    times: a replay calls this once per request over every cached block, so the five separate
    `curve_at` calls (each rebuilding the padded curves and binary-searching a 6-point grid) were most
    of a replay's time. Bit-identical to the per-call form (tests/test_eviction_fast_path.py checks)."""
    grid = np.concatenate([[0.0], np.asarray(horizons_ms, np.float64)])
    n, h1 = len(curves), len(grid)
    f = np.empty((n, h1))                                                      # [N, H + 1], F(0) = 0
    f[:, 0] = 0.0
    f[:, 1:] = curves
    t = np.empty((1 + len(multiples), n))                                      # [1 + K, N]
    t[0] = idle_ms
    for i, k in enumerate(multiples):
        t[i + 1] = idle_ms + residency_ms * k
    np.clip(t, 0.0, grid[-1], out=t)
    # The segment's left end: searchsorted(grid, t, "right") - 1 clipped to [0, H - 1]; grid[0] = 0 <= t
    # always and t <= grid[-1], so it counts the inner grid points at or below t.
    jm = (t >= grid[1]).view(np.uint8)         # H <= 255 horizons (a uint8 count is 4x cheaper than intp)
    for g in grid[2:-1]:
        jm += t >= g
    jm = jm.astype(np.intp)
    w = t
    w -= np.take(grid, jm)
    w /= np.take(np.diff(grid), jm)                                            # (t - lo) / (hi - lo)
    jm += np.arange(n) * h1                                                    # flat index of F(lo)
    flat = f.ravel()
    at = np.take(flat, jm + 1, mode="wrap")                                    # (indices are in range:
    at *= w                                                                    #  "wrap" skips the check)
    w -= 1.0
    w *= -1.0                                                                  # 1 - w, exactly
    w *= np.take(flat, jm, mode="wrap")
    at += w                                                                    # F(t) [1 + K, N]
    f0 = at[0]
    gain = np.mean(at[1:], axis=0) - f0
    return gain / np.maximum(1.0 - f0, 1e-9)


def first_n(keys: tuple[np.ndarray, ...], n: int) -> np.ndarray:
    """`np.lexsort(keys)[:n]` (the last key is the primary one) without sorting every row: only rows whose
    primary key is at most the n-th smallest can be among the first n, so only they are sorted. A
    replay asks for a few victims among thousands of cached blocks at every request."""
    primary = keys[-1]
    if n >= len(primary):
        return np.lexsort(keys)[:n]
    if n <= 0:
        return np.zeros(0, np.intp)
    kth = np.partition(primary, n - 1)[n - 1]
    if kth != kth:                        # NaN among the first n: lexsort's own NaN order decides
        return np.lexsort(keys)[:n]
    sub = np.flatnonzero(primary <= kth)   # increasing, so lexsort's stable ties keep their order
    return sub[np.lexsort(tuple(k[sub] for k in keys))][:n]


class Residency:
    """Little's law: mean time in cache = cached blocks / eviction rate; the rate is a moving average
    over the intervals between eviction calls. Until the first estimate it answers `initial_ms`."""

    def __init__(self, initial_ms: float, smoothing: float = 0.05):
        self.value_ms = initial_ms
        self._rate: float | None = None
        self._since_ms: float | None = None
        self._pending = 0
        self._smoothing = smoothing

    def update(self, now_ms: float, evicted: int, cached: int) -> float:
        if self._since_ms is None:
            self._since_ms = now_ms
        dt = now_ms - self._since_ms
        if dt > 0:
            rate = self._pending / dt
            self._rate = rate if self._rate is None else self._rate + self._smoothing * (rate - self._rate)
            self._since_ms, self._pending = now_ms, 0
        self._pending += evicted
        if self._rate:
            self.value_ms = cached / self._rate
        return self.value_ms


class ConfidenceThreshold:
    """The hot/cold threshold on P(reuse within the decision horizon) (`stratum_dmlp_confidence`).

    `calibrate` moves it towards the threshold that classifies recent outcomes best, at most `step` per
    call and never outside [low, high], so a burst of odd traffic cannot swing it far. Thread-safe.
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

    def set(self, value: float) -> float:
        """Sets the threshold (clipped to the bounds), e.g. to a value calibrated in another process."""
        with self._lock:
            self._value = float(np.clip(value, self.low, self.high))
            return self._value

    def calibrate(self, probs: np.ndarray, reused: np.ndarray) -> float:
        """probs, reused: [N] predictions and outcomes (0/1) at the decision horizon."""
        if len(probs) == 0:
            return self._value
        grid = np.linspace(self.low, self.high, 19)
        acc = ((probs[None, :] >= grid[:, None]) == (reused[None, :] > 0.5)).mean(1)
        best = grid[np.flatnonzero(acc >= acc.max() - 1e-12)]
        with self._lock:
            target = best[np.argmin(np.abs(best - self._value))]
            self._value = float(np.clip(target, self._value - self.step, self._value + self.step))
            return self._value

    def export(self, registry) -> None:
        """Registers the `stratum_dmlp_confidence` gauge in a prometheus_client registry."""
        import prometheus_client as prom
        prom.Gauge("stratum_dmlp_confidence", "DMLP hot/cold threshold on P(reuse within the decision "
                   "horizon).", registry=registry).set_function(lambda: self._value)


@dataclasses.dataclass
class ScoreStats:
    """How the policy ran its model: lazy calls made when a decision found no curve (each waits for its
    result), score-ahead calls (dispatched, not waited for), and reads of a dispatched batch that had to
    wait because the device had not finished it. With score-ahead, page-size choices never wait (see
    `DmlpPolicy._known_reuse_probability`)."""
    sync_calls: int = 0
    sync_rows: int = 0
    ahead_calls: int = 0
    ahead_rows: int = 0
    blocking_reads: int = 0
    page_size_defaults: int = 0        # page-size choices with no prefix curve computed yet (default rule)
    page_size_older_curves: int = 0    # prefix blocks judged by the curve of an earlier access


@dataclasses.dataclass(eq=False)
class _AheadBatch:
    """One dispatched batch of accesses: the prediction, and the block ids and access times of its rows."""
    pending: object              # model.PendingPrediction (or anything with ready() and result())
    block_ids: list
    access_ms: list


def tracked_block(block_id, fraction: float) -> bool:
    """Whether a block belongs to the sampled `fraction` of blocks (by its id's hash: stable within a
    process, independent of the block's features, so the sample is unbiased)."""
    if fraction >= 1.0:
        return True
    mixed = (hash(block_id) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF   # spreads small ints too
    return (mixed >> 48) < fraction * 0x10000


class DmlpPolicy:
    """Eviction, prefetch and page size from predicted reuse.

    predictor: the DMLP (the online fine-tuner may hot-swap its params at any time).
    threshold: the hot/cold threshold, shared with the fine-tuner that calibrates it.
    decision_horizon: index of the horizon that hot/cold and prefetch refer to (default the longest).
    on_access(block_ids, raw [N, F], now_ms): called by `observe_access` with the features it scored,
    e.g. `OutcomeTracker.accessed`, which turns them into online training examples.
    on_idle(now_ms): called by `tick` while the engine has no work, e.g. `OutcomeTracker.idle`, so
    accesses whose horizons have passed become training examples even when no new access comes.
    score_on_access: run the model in `observe_access` (True), or only when a decision needs a block's
    curve (False: the engine's choice; a block accessed and evicted without ever being ranked is never
    scored, and a cache whose victims are all idle past the horizons never runs the model at all).
    score_ahead: with score_on_access False, launch the model on each batch of accesses in `observe_access`
    without waiting (`predictor.dispatch`), and read the curves only when a decision needs them, by which
    time they are usually computed. The curves are the ones lazy scoring would compute (the features of the
    same access, the same weights unless a swap came in between), so decisions are the same; what changes
    is when the work runs. Why: a synchronous prediction on the engine thread waits for the device queue,
    behind the step in flight (issue #13: the GPU sat idle 23-45% of the time under the DMLP), and lazy
    scoring made one such call per admission and per ranking. Counted in `score_stats`.
    track_fraction: the share of blocks whose accesses reach `on_access` (chosen by block id, so a tracked
    block has every access tracked and its labels stay exact). Online fine-tuning does not need every
    access of a busy server, and the engine thread pays for each one it hands over.
    guard: a `ShadowLruGuard` (guard.py) that sees every access and eviction; while it is active,
    victims go in LRU order and the model ranks only the guard's ghost DMLP cache (ghost.py), which the
    policy gives the guard, with its own residency estimate (the ghost's evictions are not the real
    cache's). None: no guard.
    Thread-safe: the curve store is guarded by a lock.
    """

    pool_lru = False
    exported_to = None      # the metrics registry `runtime.export_dmlp_metrics` registered it in

    def __init__(self, predictor: "Predictor", threshold: ConfidenceThreshold | None = None,
                 decision_horizon: int = -1, on_access=None, score_on_access: bool = True, on_idle=None,
                 track_fraction: float = 1.0, guard: ShadowLruGuard | None = None, score_ahead: bool = False):
        if score_ahead and score_on_access:
            raise ValueError("score_ahead applies to lazy scoring: pass score_on_access=False with it")
        if not 0.0 < track_fraction <= 1.0:
            raise ValueError(f"track_fraction must lie in (0, 1], got {track_fraction}")
        self.track_fraction = track_fraction
        self.predictor = predictor
        self.threshold = threshold or ConfidenceThreshold()
        self.on_access = on_access
        self.on_idle = on_idle
        self.score_on_access = score_on_access
        self.score_ahead = score_ahead
        self._ahead: dict[object, tuple[_AheadBatch, int, float]] = {}   # block id -> (batch, row, access ms)
        self._ahead_batches: collections.deque[_AheadBatch] = collections.deque()   # oldest first
        self.score_stats = ScoreStats()
        self.horizons_ms = tuple(predictor.config.horizons_ms)
        self.decision_horizon = decision_horizon
        self.residency = Residency(initial_ms=self.horizons_ms[-1])
        self._curves: dict[object, tuple[np.ndarray, float]] = {}   # block id -> (curve [H], access ms)
        self._lock = threading.Lock()
        self.guard = guard
        if guard is not None and guard.ghost is None:
            self._ghost_residency = Residency(initial_ms=self.horizons_ms[-1])
            # min_slack: one ranking (and one model call) per 8 insertions at least (ghost.py). Scored at
            # the ranking, on the engine thread: scoring on the ghost's worker thread (`background`) made
            # the tiny CPU model's decode step slower, not faster (BENCHMARKS.md, #15, session 8).
            guard.bind(GhostDmlpCache(self._order_ghost, len(self.horizons_ms), score=self._score_ghost,
                                      min_slack=8))
        # The weights the guard last judged (a guarded policy's predictor must have `params`).
        self._guarded_params = predictor.params if guard is not None else None

    @property
    def idle_tick_ms(self) -> float | None:
        """How often an idle engine should call `tick` (its longest horizon), or None when there is no
        `on_idle` to feed."""
        return self.horizons_ms[-1] if self.on_idle is not None else None

    def tick(self, now_ms: float) -> None:
        """The engine is idle: lets `on_idle` close the accesses whose horizons have passed."""
        if self.on_idle is not None:
            self.on_idle(now_ms)

    @property
    def lru_beyond_ms(self) -> float:
        """A candidate idle for longer than this scores 0 (the model knows nothing past its longest
        horizon), and ties go to the least recently used. So when the least recently used candidate is
        idle that long, it is the first victim, and a caller may take it without asking (then it calls
        `note_evictions`, so the residency estimate still sees every eviction)."""
        return self.horizons_ms[-1]

    def note_evictions(self, n: int, now_ms: float, cached: int) -> None:
        """Counts evictions that no `choose_victims` call counted: ones past `lru_beyond_ms`, and each
        one a caller makes from a ranking it asked for with evicting=0."""
        self.residency.update(now_ms, n, cached)

    # ---- array level (the simulator calls this directly) ----

    def order_victims(self, curves: np.ndarray, idle_ms: np.ndarray, n: int, now_ms: float,
                      cached: int, access_seq: np.ndarray | None = None, evicting: int | None = None) -> np.ndarray:
        """curves [N, H] predicted at each candidate's last access, idle_ms [N] since then. Returns the
        indices of the n victims, best first. `cached`: blocks in the cache (for the residency).
        access_seq [N]: order of the last accesses, to break ties between equal times as LRU does.
        evicting: how many of them are evicted now, for the residency estimate (default all n); a caller
        that uses a ranking only in part passes 0 and reports each eviction with `note_evictions`."""
        evicted = min(n, len(idle_ms)) if evicting is None else evicting
        residency = self.residency.update(now_ms, evicted, cached)
        seq = np.zeros(len(idle_ms)) if access_seq is None else access_seq
        if self.lru_mode:
            return first_n((seq, -idle_ms), n)
        return self._rank(curves, idle_ms, n, residency, seq)

    def _rank(self, curves: np.ndarray, idle_ms: np.ndarray, n: int, residency_ms: float,
              access_seq: np.ndarray) -> np.ndarray:
        """The DMLP's first n victims: lowest `reuse_before_eviction`, ties to the least recently used."""
        score = reuse_before_eviction(curves, self.horizons_ms, idle_ms, residency_ms)
        return first_n((access_seq, -idle_ms, score), n)

    def _score_ghost(self, infos: list) -> np.ndarray:
        """Curves [N, H] of the ghost DMLP's keys from their BlockInfo snapshots (the live weights)."""
        return self.predictor.predict(raw_from_infos(infos))

    def _order_ghost(self, curves: np.ndarray, idle_ms: np.ndarray, n: int, now_ms: float, cached: int,
                     access_seq: np.ndarray) -> np.ndarray:
        """The guard's ghost DMLP's victims (same arguments as order_victims), ranked as the real cache's
        would be, with the ghost's own residency (its own evictions)."""
        residency = self._ghost_residency.update(now_ms, min(n, len(idle_ms)), cached)
        return self._rank(curves, idle_ms, n, residency, access_seq)

    @property
    def lru_mode(self) -> bool:
        """True while the guard has victims go in LRU order (curves are then not needed)."""
        return self.guard is not None and self.guard.active

    def guard_accessed(self, block_ids: Sequence, curves: np.ndarray | None = None, t_ms: float = 0.0,
                       infos: Sequence[BlockInfo] | None = None) -> None:
        """Shows accesses (in order, at t_ms; curves [N, H] at them when known, else maybe their BlockInfo
        snapshots for the ghost DMLP to score when it ranks) to the guard,
        and tells it when the weights changed since it last looked (an online swap replaces
        `predictor.params`). The engine calls it through `observe_access`, the cache simulator directly."""
        if self.guard is None:
            return
        if self.predictor.params is not self._guarded_params:
            self._guarded_params = self.predictor.params
            self.guard.model_changed()
        self.guard.accessed(block_ids, curves, t_ms, infos)

    def model_changed(self) -> None:
        """The weights changed (a replay that swaps curves, not `predictor.params`, says so here)."""
        if self.guard is not None:
            self.guard.model_changed()

    def tracked_indices(self, block_ids: Sequence) -> list[int]:
        """Indices of the accesses whose blocks belong to the tracked share (`track_fraction`)."""
        return [i for i, b in enumerate(block_ids) if tracked_block(b, self.track_fraction)]

    def track_accesses(self, block_ids: Sequence, raw: np.ndarray, now_ms: float) -> None:
        """Hands the tracked share of accesses (raw [N, F]: features at this access) to `on_access`, which
        labels them for online fine-tuning: what `observe_access` does for the engine, for callers that
        already hold the feature rows (the cache simulator's online replay), so both sample alike."""
        keep = self.tracked_indices(block_ids) if self.on_access is not None else []
        if keep:
            self.on_access([block_ids[i] for i in keep], raw[keep], now_ms)

    # ---- engine level ----

    def observe_access(self, infos: Sequence[BlockInfo]) -> np.ndarray | None:
        """Scores blocks a request just used (features at this access, `last_access_ms` = now) and keeps
        their curves for later evictions. Returns P(reuse within each horizon) [N, H] (None when
        `score_on_access` is off: then they are scored when first needed).
        `needed_by_running` plays no part here (it is not a model input)."""
        if not infos:
            return np.zeros((0, len(self.horizons_ms)), np.float32)
        # In LRU mode the real ranking never runs, so the guard's ghost DMLP gets the step's features
        # here and scores them itself when it ranks (in DMLP mode it learns the curves the real
        # ranking computes, through _score).
        ahead = self.score_ahead and not self.lru_mode     # in LRU mode no ranking reads the curves
        raw = raw_from_infos(infos) if self.score_on_access or ahead else None
        probs = self._score(infos, raw) if self.score_on_access else None
        if ahead:
            self._score_ahead(infos, raw)
        self.guard_accessed([b.block_id for b in infos], probs, max(b.last_access_ms for b in infos),
                            infos if self.lru_mode and probs is None else None)
        if not self.score_on_access:
            probs = None
            if self.on_access is None:
                return None
        if self.on_access is not None:
            now = max(b.last_access_ms for b in infos)
            keep = self.tracked_indices([b.block_id for b in infos])
            if keep:
                tracked = [infos[i] for i in keep]
                self.on_access([b.block_id for b in tracked],
                               raw[keep] if raw is not None else raw_from_infos(tracked), now)
        return probs

    # Score-ahead: at most this many dispatched batches stay unread; older ones are read (waiting if need
    # be) so a device that never reports ready cannot grow the store without bound.
    MAX_AHEAD_BATCHES = 8

    def _score_ahead(self, infos: Sequence[BlockInfo], raw: np.ndarray) -> None:
        """Launches the model on this batch of accesses; first reads the batches already computed."""
        self._read_ready_batches()
        batch = _AheadBatch(self.predictor.dispatch(raw), [b.block_id for b in infos],
                            [b.last_access_ms for b in infos])
        self.score_stats.ahead_calls += 1
        self.score_stats.ahead_rows += len(infos)
        with self._lock:
            for row, b in enumerate(infos):
                self._ahead[b.block_id] = (batch, row, b.last_access_ms)
        self._ahead_batches.append(batch)
        while len(self._ahead_batches) > self.MAX_AHEAD_BATCHES:
            self._read_batch(self._ahead_batches[0])

    def _read_ready_batches(self) -> None:
        """Stores the curves of every dispatched batch the device has finished, oldest first, no waiting."""
        while self._ahead_batches and self._ahead_batches[0].pending.ready():
            self._read_batch(self._ahead_batches[0])

    def _read_batch(self, batch: "_AheadBatch") -> None:
        """Reads one dispatched batch (waiting if it is not done: counted) and stores its curves for the
        blocks not accessed again since."""
        if not batch.pending.ready():
            self.score_stats.blocking_reads += 1
        probs = batch.pending.result()
        keep = []
        with self._lock:
            for row, (block_id, t) in enumerate(zip(batch.block_ids, batch.access_ms)):
                entry = self._ahead.get(block_id)
                if entry is not None and entry[0] is batch and entry[1] == row:
                    del self._ahead[block_id]
                    self._curves[block_id] = (probs[row], t)
                    keep.append(row)
        try:
            self._ahead_batches.remove(batch)
        except ValueError:
            pass
        if self.guard is not None and keep:
            self.guard.note_curves([batch.block_ids[r] for r in keep], probs[keep], [batch.access_ms[r] for r in keep])

    def _take_ahead(self, blocks: Sequence[BlockInfo], stale: list[int], got: list) -> list[int]:
        """Fills `got` for the stale blocks whose current access was dispatched ahead (reading their
        batches); returns the indices still without a curve."""
        with self._lock:
            entries = [self._ahead.get(blocks[i].block_id) for i in stale]
        for e, i in zip(entries, stale):
            if e is not None and e[2] == blocks[i].last_access_ms and e[0] in self._ahead_batches:
                self._read_batch(e[0])
        with self._lock:
            for i in stale:
                got[i] = self._curves.get(blocks[i].block_id)
        return [i for i in stale if got[i] is None or got[i][1] != blocks[i].last_access_ms]

    def _score(self, infos: Sequence[BlockInfo], raw: np.ndarray) -> np.ndarray:
        probs = self.predictor.predict(raw)
        with self._lock:
            for b, p in zip(infos, probs):
                self._curves[b.block_id] = (p, b.last_access_ms)
        if self.guard is not None:
            self.guard.note_curves([b.block_id for b in infos], probs, [b.last_access_ms for b in infos])
        return probs

    def forget(self, block_ids) -> None:
        """Drops stored curves of blocks that left every tier (and tells the guard they left)."""
        if self.guard is not None:
            block_ids = list(block_ids)
            self.guard.forget(block_ids)
        with self._lock:
            for b in block_ids:
                self._curves.pop(b, None)
                self._ahead.pop(b, None)

    def choose_victims(self, candidates: Sequence[BlockInfo], n: int, now_ms: float,
                       cached: int | None = None, evicting: int | None = None) -> list:
        """The n victims, first to evict first. cached: blocks in the cache, when `candidates` is not
        all of them (for the residency estimate); default len(candidates). evicting: see order_victims."""
        free = [b for b in candidates if not b.needed_by_running]
        if not free or n <= 0:
            return []
        curves = None if self.lru_mode else self._curves_of(free)
        idle = now_ms - np.fromiter((b.last_access_ms for b in free), np.float64, len(free))
        cached = len(candidates) if cached is None else cached
        return [free[i].block_id for i in self.order_victims(curves, idle, n, now_ms, cached, evicting=evicting)]

    def prefetch_order(self, candidates: Sequence[BlockInfo], now_ms: float) -> list:
        """Host-tier blocks of queued requests, most likely to be used within the decision horizon first."""
        if not candidates:
            return []
        p = self.reuse_probability(candidates, now_ms)
        return [candidates[i].block_id for i in np.argsort(-p, kind="stable")]

    def is_hot(self, blocks: Sequence[BlockInfo], now_ms: float) -> np.ndarray:
        """bool [N]: P(reuse within the decision horizon) >= stratum_dmlp_confidence."""
        return self.reuse_probability(blocks, now_ms) >= self.threshold.value

    def page_size_for(self, hints: PageSizeHints, prefix_blocks: Sequence[BlockInfo] = (),
                      now_ms: float = 0.0) -> int:
        """The default rule, then one class smaller when the request's prefix blocks are hot (they will be
        shared again: finer pages share at a finer grain, and waste less when a tail is dropped) and one
        class larger when they are cold (private: fewer, bigger copies)."""
        size = DefaultPageSizeRule()(hints)
        if not prefix_blocks:
            return size
        if self.score_ahead:
            # Admission never waits for the model: the prefix's curves as computed so far (see
            # `_known_reuse_probability`); none yet: the default rule.
            probs = self._known_reuse_probability(prefix_blocks, now_ms)
            if probs is None:
                self.score_stats.page_size_defaults += 1
                return size
            p = float(np.mean(probs))
        else:
            p = float(np.mean(self.reuse_probability(prefix_blocks, now_ms)))
        i = PAGE_SIZE_CLASSES.index(size)
        if p >= self.threshold.value:
            i -= 1
        elif p < 1.0 - self.threshold.value:
            i += 1
        return PAGE_SIZE_CLASSES[min(max(i, 0), len(PAGE_SIZE_CLASSES) - 1)]

    def reuse_probability(self, blocks: Sequence[BlockInfo], now_ms: float) -> np.ndarray:
        """[N]: P(used within the decision horizon from now), given each block's idle time."""
        idle = np.array([now_ms - b.last_access_ms for b in blocks], np.float64)
        window = self.horizons_ms[self.decision_horizon]
        return reuse_within(self._curves_of(blocks), self.horizons_ms, idle, window)

    def _known_reuse_probability(self, blocks: Sequence[BlockInfo], now_ms: float) -> np.ndarray | None:
        """`reuse_probability` over the blocks that have a computed curve, without running or waiting for
        the model (None if none has). A block accessed again since its curve was predicted keeps that
        curve, with its idle time counted from its latest access: a block's reuse curves at successive
        accesses are alike, while counting from the older access would call a block just reused idle.
        Why: a prefix block is typically accessed by the admission before this one, in the same pass, so
        its current curve is still on the device behind the step in flight (issue #13)."""
        self._read_ready_batches()
        with self._lock:
            got = [self._curves.get(b.block_id) for b in blocks]
        known = [i for i, g in enumerate(got) if g is not None]
        self.score_stats.page_size_older_curves += sum(got[i][1] != blocks[i].last_access_ms for i in known)
        if not known:
            return None
        idle = np.array([now_ms - blocks[i].last_access_ms for i in known], np.float64)
        window = self.horizons_ms[self.decision_horizon]
        curves = np.stack([got[i][0] for i in known]).astype(np.float64)
        return reuse_within(curves, self.horizons_ms, idle, window)

    def _curves_of(self, blocks: Sequence[BlockInfo]) -> np.ndarray:
        """Stored curves [N, H]; blocks scored at an older access (or never) are scored now from their
        BlockInfo, which holds the features of their last access."""
        with self._lock:
            got = [self._curves.get(b.block_id) for b in blocks]
        stale = [i for i, (b, g) in enumerate(zip(blocks, got)) if g is None or g[1] != b.last_access_ms]
        if stale and self._ahead:
            stale = self._take_ahead(blocks, stale, got)
        if stale:
            self.score_stats.sync_calls += 1
            self.score_stats.sync_rows += len(stale)
            infos = [blocks[i] for i in stale]
            fresh = self._score(infos, raw_from_infos(infos))
            for i, p in zip(stale, fresh):
                got[i] = (p, blocks[i].last_access_ms)
        return np.stack([g[0] for g in got]).astype(np.float64)
