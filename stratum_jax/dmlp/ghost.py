"""A ghost DMLP cache: block keys (with each one's reuse curve at its last access), no data, evicting by
the DMLP's own ranking. The shadow-LRU guard (guard.py) runs it while the real cache evicts in LRU order,
to see what the DMLP would have hit over the same accesses, so that it can judge a return to the DMLP
without handing it real windows.

What it holds. While the real cache is the DMLP's (`mirror=True`), the ghost mirrors the real resident
set: a key enters on access and leaves when the real cache forgets it, and nothing is ranked, so the
ghost costs a dict update and a row copy per access there. At a trip it is, block for block, the cache
the DMLP built. From then on (`mirror=False`) the real cache's evictions no longer reach it; it evicts
by itself (`fit`, after each access), whenever it holds more than `capacity` (the real cache's current
resident count) plus a slack, with the ranking `order` gives (the policy's: lowest P(used before it would leave) first, ties to
the least recently used), never among the keys of the access that made it overflow (the engine's and
the replay's running request).

Why a slack. A ranking costs a pass over every ghost key (`reuse_before_eviction` over [N, H] curves);
ranking at every access that overflows would cost N per access. The ghost instead lets itself reach
`capacity + slack/2` and then evicts down to `capacity - slack/2`: one ranking per `slack` insertions,
and the mean size over a cycle is the real cache's, so the ghost is neither larger nor smaller than the
cache it stands for (its size wobbles by +- slack/2, `slack_frac` of capacity: 1/64 by default, and at
least `min_slack`: the engine's policy asks for 8 blocks, so that on a small pool the ghost does not run
the model at every step; on the CPU each such call waits for the engine's in-flight device step).

Curves. In the replay every access comes with its curve. In the engine, which scores lazily: while the
ghost mirrors the real cache, an access comes with no curve and the policy hands over the curves the
real ranking computes (`note_curves`); a key still without one at a trip keeps a zero curve, which
scores 0, so it goes first, in LRU order, as an idle-past-the-horizons block does in the real policy.
While the ghost evicts by itself, accesses come with their features (the engine's per-access BlockInfo
snapshots, kept by reference), and the ghost scores the ones a ranking needs in one model call per
ranking (`score`), not a feature matrix and a model call per engine step.

On a worker thread (`background=True`; an option, off in the engine's policy). A model call on the engine
thread waits, on the CPU, for the device step in flight (session 7: the tripped guard at +15.6% decode
step p50 over LRU on the tiny model). With `background`, each access batch's features go at once to a
worker thread that scores them (one call per batch, FIFO), and a ranking takes the curves from there,
waiting only for a batch not finished yet (`waits` counts such rankings). The curves are the same
whichever thread computes them and whenever (a batch is scored as it arrived), so the ghost's hits do
not depend on timing, except across an online weight swap (a batch scored just before or after it gets
the old or the new weights, as a real access's curve does). Measured, it made the step slower, not
faster (BENCHMARKS.md, #15, session 8): a thread shares the process's XLA CPU queue and GIL with the
engine, and a call per access batch is more calls than one per ranking; so it stays off.

Memory: one key, one float32 curve [H], a time and a sequence number per block of the real cache's
resident set (plus slack/2), the same order as the real policy's own curve store.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

# order(curves [N, H], idle_ms [N], n, now_ms, cached, access_seq [N]) -> indices [n] of the victims, first first.
Order = Callable[..., np.ndarray]
# score(features: a list of N per-access feature records) -> curves [N, H]: the model, for keys accessed
# with their features but no curve (the engine's BlockInfo snapshots).
Score = Callable[[list], np.ndarray]
# The last access of a key that came back without one (`start_mirroring`): idle past any horizon.
LONG_AGO_MS = -1e15


def unprotected_slots(num_slots: int, slot_of: dict, protected) -> np.ndarray:
    """Slots [0, num_slots) that may be evicted: all but those of the `protected` keys (the running
    access's), found by slot through `slot_of` (an isin over every cached key costs more). Shared by the
    ghost and the offline simulator (training/simulator.py)."""
    free = np.ones(num_slots, bool)
    for k in protected:
        s = slot_of.get(k)
        if s is not None:
            free[s] = False
    return np.flatnonzero(free)


class _Scored:
    """Row `row` of an access batch scored on the background thread: `future` -> curves [N, H]."""

    __slots__ = ("future", "row")

    def __init__(self, future: Future, row: int):
        self.future, self.row = future, row


class GhostDmlpCache:
    """order: the DMLP's victim ranking (see module doc). num_horizons: H. slack_frac: eviction batch,
    as a share of capacity, and at least `min_slack` blocks. score: the model, for keys accessed with their features
    instead of a curve: they are scored lazily, together, when a ranking needs them (one model call per
    ranking instead of a feature matrix and a model call per access batch). background: score each
    access batch's features on a worker thread as it arrives instead (module doc: off the engine's step)."""

    def __init__(self, order: Order, num_horizons: int, slack_frac: float = 1.0 / 64,
                 score: Score | None = None, min_slack: int = 1, background: bool = False):
        if not 0.0 <= slack_frac < 1.0:
            raise ValueError(f"ghost slack_frac must lie in [0, 1), got {slack_frac}")
        if min_slack < 1:
            raise ValueError(f"ghost min_slack must be >= 1 block, got {min_slack}")
        self.order, self.slack_frac, self.score, self.min_slack = order, slack_frac, score, min_slack
        # Per slot: the features of a key not scored yet (or its _Scored row, in the background), else None.
        self._feat: list = []
        self._pool = None
        self.background = background
        self.waits = 0               # rankings that waited for background scoring not finished yet
        self.mirror = True
        self._slot: dict[Hashable, int] = {}
        self._keys: list = []
        self._curve = np.zeros((16, num_horizons), np.float32)
        self._t = np.zeros(16, np.float64)
        self._seq = np.zeros(16, np.int64)
        self._clock = 0
        self.rankings = 0            # rankings run (the ghost's cost, for reports)

    @property
    def background(self) -> bool:
        """Whether accesses' features are scored on the worker thread (module doc); settable, e.g. by a
        benchmark that compares both (keys already sent keep their background scores)."""
        return self._pool is not None

    @background.setter
    def background(self, on: bool) -> None:
        if on and self.score is None:
            raise ValueError("a ghost that scores in the background needs a score function")
        if on and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dmlp-ghost-score")
        elif not on and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._slot

    def access(self, keys: Sequence[Hashable], curves: np.ndarray | None, t_ms: float,
               features: Sequence | None = None) -> list[bool]:
        """Blocks used, in order (one request, or one engine step, at t_ms): returns, per key, whether the
        ghost held it before this access. curves [N, H] at this access; else `features` (N records),
        scored when a ranking needs them (needs `score`); neither: not known, kept as zeros. Evicts
        nothing: `fit` does, once the real cache's size is known."""
        if curves is None and features is not None and self.score is None:
            raise ValueError("a ghost without a score function needs curves, not features")
        if curves is None and features is not None and self._pool is not None and len(keys):
            batch = self._pool.submit(self.score, list(features))
            features = [_Scored(batch, i) for i in range(len(keys))]
        hits = []
        for i, k in enumerate(keys):
            s = self._slot.get(k)
            hits.append(s is not None)
            if s is None:
                s = self._slot[k] = len(self._keys)
                self._keys.append(k)
                self._feat.append(None)
                if s == len(self._t):
                    self._grow()
                self._curve[s] = 0.0
            if curves is not None:
                self._curve[s] = curves[i]
                self._feat[s] = None
            else:
                self._feat[s] = None if features is None else features[i]
            self._t[s] = t_ms
            self._clock += 1
            self._seq[s] = self._clock
        return hits

    def fit(self, capacity: int, protected: set, now_ms: float) -> None:
        """Evicts by the DMLP's ranking, never a key in `protected` (the running request's), when the
        ghost holds more than capacity + slack/2 keys, down to capacity - slack/2 (module doc). Nothing while it
        mirrors the real cache (whose own evictions reach it through `forget`)."""
        half = max(self.min_slack, round(self.slack_frac * capacity)) // 2
        if self.mirror or len(self._keys) <= capacity + half:
            return
        n = len(self._keys) - max(capacity - half, 0)
        cand = unprotected_slots(len(self._keys), self._slot, protected)
        if len(cand) == 0:
            return
        self.rankings += 1
        feat = self._feat
        stale = [s for s in cand.tolist() if feat[s] is not None] if self.score is not None else []
        if stale:
            self._take_scores(stale)
        chosen = cand[self.order(self._curve[cand].astype(np.float64), now_ms - self._t[cand], n, now_ms,
                                 len(self._keys), self._seq[cand])]
        self._remove(chosen.tolist())

    def _take_scores(self, slots: list[int]) -> None:
        """Curves for `slots`, whose keys were accessed with features: from the background batches they were
        sent to (waiting for any not finished), the rest in one model call here."""
        feat, here, batches, waited = self._feat, [], {}, False
        for s in slots:
            f = feat[s]
            if isinstance(f, _Scored):
                got = batches.get(f.future)
                if got is None:
                    waited |= not f.future.done()
                    got = batches[f.future] = f.future.result()
                self._curve[s] = got[f.row]
            else:
                here.append(s)
        if here:
            self._curve[here] = self.score([feat[s] for s in here])
        for s in slots:
            feat[s] = None
        self.waits += waited

    def start_mirroring(self, resident: Iterable[Hashable]) -> None:
        """The real cache is the DMLP's again: the ghost becomes its mirror. Keys the real cache no
        longer holds leave; keys it holds that the ghost had evicted come back as long idle, with no
        curve (they are first to go, as blocks untouched since before the return would be)."""
        resident = set(resident)
        self._remove([s for s, k in enumerate(self._keys) if k not in resident])
        for k in resident - self._slot.keys():
            s = self._slot[k] = len(self._keys)
            self._keys.append(k)
            if s == len(self._t):
                self._grow()
            self._feat.append(None)
            self._curve[s], self._t[s], self._seq[s] = 0.0, LONG_AGO_MS, 0
        self.mirror = True

    def note_curves(self, keys: Sequence[Hashable], curves: np.ndarray, t_ms: Sequence[float]) -> None:
        """Curves the policy computed (curves [N, H] predicted at the access at t_ms [N]): taken for keys
        the ghost holds with that same last access."""
        for k, c, t in zip(keys, curves, t_ms):
            s = self._slot.get(k)
            if s is not None and self._t[s] == t:
                self._curve[s], self._feat[s] = c, None

    def forget(self, keys) -> None:
        """Blocks that left the real cache: they leave the ghost too while it mirrors it."""
        if self.mirror:
            for k in keys:
                if k in self._slot:
                    self._remove([self._slot[k]])

    def _remove(self, slots: list[int]) -> None:
        for s in sorted(slots, reverse=True):       # swap-remove, highest slot first
            del self._slot[self._keys[s]]
            last = len(self._keys) - 1
            if s != last:
                k = self._keys[s] = self._keys[last]
                self._curve[s], self._t[s], self._seq[s] = self._curve[last], self._t[last], self._seq[last]
                self._feat[s] = self._feat[last]
                self._slot[k] = s
            self._keys.pop()
            self._feat.pop()

    def _grow(self) -> None:
        n = 2 * len(self._t)
        self._curve = np.resize(self._curve, (n, self._curve.shape[1]))
        self._t, self._seq = np.resize(self._t, n), np.resize(self._seq, n)
